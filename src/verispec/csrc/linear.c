/* ======== linear: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]); x [M, K], w [N, K], y [M, N] ========
 * float32, bfloat16 and int8 weights (a vector source: compiled once per ISA, see simd.h).
 * Exactness: every y[m, n] owns one accumulator vector, fed x[m, k:k+L] * w[n, k:k+L] by one fused
 * multiply-add per L lanes in increasing k (a zero-filled tail last), then reduced by a fixed
 * shuffle sequence. The tile shape (how many rows share a pass over the weights) only decides which
 * accumulators are live together, never the arithmetic one of them sees. */
#include "common.h"
#include "simd.h"

#define W f32
#define WT float
#define WLOAD VLOAD
#define WLOADN VLOADN
#define WSCALE(sum, scale) (sum)
#include "linear_tiles.h"

#define W bf16
#define WT uint16_t
#define WLOAD VLOAD_BF16
#define WLOADN VLOADN_BF16
#define WSCALE(sum, scale) (sum)
#include "linear_tiles.h"

#define W i8
#define WT int8_t
#define WLOAD VLOAD_I8
#define WLOADN VLOADN_I8
#define WSCALE(sum, scale) ((sum) * (scale))  /* int8 rows: the row's scale, once, on the finished sum */
#include "linear_tiles.h"
