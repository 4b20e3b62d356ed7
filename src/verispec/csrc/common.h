/* What the kernel sources share: layout constants, the jobs handed to the thread pool, and the
 * functions one source calls in another. Functions marked per ISA exist twice, NAME_512 and
 * NAME_256: their source is compiled once per ISA (see simd.h). Everything here is internal to the
 * library (built with -fvisibility=hidden); the entry points Python calls are in kernels.h. */
#ifndef VS_COMMON_H
#define VS_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"

/* Built with -ffp-contract=off: the compiler never fuses a*b+c by itself, so scalar code rounds
 * exactly as written and only the explicit fmadd intrinsics fuse. */

#define NR 4           /* weight rows per linear tile */
#define KBLOCK 512     /* k per pass of the row tiles: 4 weight rows + 6 activation rows = 20 KB, in L1 */
#define I4GROUP 64     /* int4 weights per scale, along k */
#define I4MAXSHRINKS 16  /* most candidate scales per int4 group (Int4Matrix.SHRINKS) */
#define SLOT_BLOCK 16  /* slots per key block: keys are [capacity / 16, D, 16] per (row, kv head) */
#define MAX_GROUP 4    /* matrices per grouped product (a layer's q, k, v; gate and up) */
#define PNR 16         /* output rows per panel (PanelMatrix) */
#define PKC 256        /* k per panel block: a panel's block is 16 KB; the blocked GEMM's GKC, for the same sums */
#define QK_K 256       /* weights per GGUF k-quant block (and per Q8_K activation block) */
#define Q4K_BYTES 144  /* a block_q4_K */
#define Q5K_BYTES 176  /* a block_q5_K */
#define Q6K_BYTES 210  /* a block_q6_K */
#define GGML_Q4_K 12   /* ggml type ids (vs_product.kind of VS_GGUF_Q8) */
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define Q8G 16         /* columns per interleaved group of repacked GGUF blocks (kquant_q8_pack.c) */
#define Q4G_BYTES 2368 /* 16 columns' Q4_K blocks repacked: 16 d, 16 dmin (f16), 8x16 scales, 4x16x2 mins, 32x64 nibbles */
#define Q5G_BYTES 2880 /* Q5_K: Q4_K's 2368 bytes, then 32x16 bytes of fifth bits (kquant_q8_pack.c) */
#define Q6G_BYTES 3360 /* 16 columns' Q6_K blocks repacked: 16 d (f16), 8x16x2 scales, 32x64 nibbles, 16x64 high bits */

#define QK32 32        /* weights per ggml Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block (and per Q8_0 / Q8_1 activation block) */
#define GGML_Q4_0 2    /* ggml type ids of the 32-weight block types (quant32_q8.c) */
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define VS_Q3_0 99     /* verispec's own 32-weight type, no ggml one: a half-float scale and 3-bit codes (draft matrices) */
#define Q3_0_BYTES 14  /* its block: d (f16), 8 bytes of low code bit pairs, 4 bytes of high bits (kquant_rows.c) */

/* Whether a ggml type is one of the 32-weight block types, and the bytes of one of its blocks (a repacked
 * group of Q8G columns is Q8G times as many: quant32_q8_pack.c) */
static inline int ggml_is_q32(int kind)
{
    return kind == GGML_Q4_0 || kind == GGML_Q4_1 || kind == GGML_Q5_0 || kind == GGML_Q5_1 || kind == GGML_Q8_0 || kind == VS_Q3_0;
}
static inline int64_t q32_block_bytes(int kind)
{
    return kind == GGML_Q4_0 ? 18 : kind == GGML_Q4_1 ? 20 : kind == GGML_Q5_0 ? 22 : kind == GGML_Q5_1 ? 24
         : kind == VS_Q3_0 ? Q3_0_BYTES : 34;
}

/* Bytes of one repacked block group of a ggml k-quant type (GGML_Q4_K, GGML_Q5_K, GGML_Q6_K). */
static inline int64_t q8_group_bytes(int kind)
{
    return kind == GGML_Q6_K ? Q6G_BYTES : kind == GGML_Q5_K ? Q5G_BYTES : Q4G_BYTES;
}

/* ======== the thread pool (pool.c) ======== */
typedef void (*range_fn)(const void *job, int64_t begin, int64_t end);
/* fn(job, begin, end) over [0, total) in chunks of `grain`, on up to `threads` threads (caller included). */
void parallel_for(range_fn fn, const void *job, int64_t total, int64_t grain, int threads);
/* `count` jobs of one range function as one parallel_for over all their tiles (tiles[i] for job i);
 * `work` (multiply-adds) decides whether waking other threads pays. */
void run_group(range_fn fn, const void *const *jobs, const int64_t *tiles, int count, int64_t work, int threads);

/* ======== jobs ======== */
/* One linear product. s: one scale per weight row for int8 weights (w[n, k] = q[n, k] * s[n]), the
 * group scales for int4 and k-quant weights, else unused. */
typedef struct { const float *x; const void *w; const float *s; const float *b; float *y; int64_t M, N, K; } linear_job;

/* Activation rows a q8 tile multiplies against each decoded sub-block (kquant_q8.c, quant32_q8.c). Their rounded
 * activations lie in slabs of Q8SLAB rows: block b of row m is at q8_at(m, b, blocks), a slab's rows one after
 * another, block by block, so a tile reads its rows at fixed offsets from one pointer (with a pointer per row, the
 * 8-row Q4_0 tile spent more instructions on addresses and spilled registers than on products), and an AMX tile
 * loads a slab's 16 rows of a block with one stride (kquant_amx.c). A VNNI tile (Q8TILE rows, from a multiple of
 * Q8TILE) lies within one slab. */
#define Q8TILE 8
#define Q8WIDE 16  /* the most rows a k-quant tile takes in one pass over its decoded weights (a verify pass) */
#define Q8SLAB 16
static inline int64_t q8_at(int64_t m, int64_t b, int64_t blocks) { return (m / Q8SLAB * blocks + b) * Q8SLAB + m % Q8SLAB; }
/* Rows the layout holds for M: whole slabs. */
static inline int64_t q8_rows(int64_t M) { return (M + Q8SLAB - 1) / Q8SLAB * Q8SLAB; }

/* A GGUF matrix's blocks (kind: GGML_Q4_K, GGML_Q5_K or GGML_Q6_K), repacked in groups of Q8G columns by
 * gguf_q8_repack, times Q8_K activations (kquant_q8.c) in slabs (row m's block b at
 * i = q8_at(m, b, K / 256)): its 256 codes at 256 i in qx, its d at qd[i], its sums of 16 codes
 * at 16 i in qb and of 32 at 8 i in qb32. */
typedef struct { const int8_t *qx; const float *qd; const int16_t *qb, *qb32; const uint8_t *w; int kind;
                 const float *b; float *y; int64_t M, N, K;
                 /* the 32-weight types' activations, rounded as ggml's Q8_0 / Q8_1 (quant32_q8.c), in slabs of
                  * Q8SLAB rows (q8_at): qx0 int8 codes, qd0 the scales d (half-precision values), qs0 Q8_1's
                  * s = d * sum (half-precision values), qa0 the sums of the codes */
                 const int8_t *qx0; const float *qd0, *qs0; const int16_t *qa0; } q8_job;

/* Int4 quantization of rows of w (see int4_quantize_rows in int4.c). */
typedef struct { const float *w; uint8_t *packed; float *scale; const float *shrinks; int64_t K; int count; } quantize_job;

typedef struct {
    const float *q, *kc, *vc; const uint8_t *vis, *tree; float *out;
    int64_t B, T, H, KVH, D, cap, vis_stride, start; float scale; _Atomic int failed;
} attention_job;

/* ======== per ISA: compiled from the vector sources once per ISA ======== */
#define VS_PER_ISA(ret, name, params) ret name##_512 params; ret name##_256 params;
/* linear.c: weight-row tiles [begin, end) of a linear_job; the last N % NR rows one at a time (edge) */
VS_PER_ISA(void, linear_range_f32, (const void *job, int64_t begin, int64_t end))
VS_PER_ISA(void, linear_range_bf16, (const void *job, int64_t begin, int64_t end))
VS_PER_ISA(void, linear_range_i8, (const void *job, int64_t begin, int64_t end))
VS_PER_ISA(void, linear_edge_f32, (const float *x, const float *w, const float *s, const float *b, float *y,
                                   int64_t M, int64_t N, int64_t K))
VS_PER_ISA(void, linear_edge_bf16, (const float *x, const uint16_t *w, const float *s, const float *b, float *y,
                                    int64_t M, int64_t N, int64_t K))
VS_PER_ISA(void, linear_edge_i8, (const float *x, const int8_t *w, const float *s, const float *b, float *y,
                                  int64_t M, int64_t N, int64_t K))
/* int4.c */
VS_PER_ISA(void, linear_range_i4, (const void *job, int64_t begin, int64_t end))
VS_PER_ISA(void, linear_edge_i4, (const float *x, const uint8_t *w, const float *s, const float *b, float *y,
                                  int64_t M, int64_t N, int64_t K))
VS_PER_ISA(void, int4_quantize_rows, (const void *job, int64_t begin, int64_t end))
/* exact.c */
VS_PER_ISA(void, linear_range_q4k, (const void *job, int64_t begin, int64_t end))
VS_PER_ISA(void, linear_range_q6k, (const void *job, int64_t begin, int64_t end))
/* norms.c */
VS_PER_ISA(void, silu_mul_isa, (float *gate, const float *up, int64_t n))
VS_PER_ISA(void, rms_norm_isa, (float *x, const float *delta, const float *w, float *out, int64_t M, int64_t D, float eps))
/* attention.c: (batch row, kv head) pairs [begin, end) of an attention_job */
VS_PER_ISA(void, attention_range, (const void *job, int64_t begin, int64_t end))
#undef VS_PER_ISA
/* kquant_q8.c, compiled for AVX-512 BW + VNNI (_512) and AVX2 (_256): Q8_K rounding of rows, and
 * column groups [begin, end) (Q8G columns each) of a q8_job */
void q8k_quantize_512(const float *x, int8_t *qx, float *qd, int16_t *qb, int16_t *qb32, int64_t M, int64_t K);
void q8k_quantize_256(const float *x, int8_t *qx, float *qd, int16_t *qb, int16_t *qb32, int64_t M, int64_t K);
void q8_range_512(const void *job, int64_t begin, int64_t end);
void q8_range_256(const void *job, int64_t begin, int64_t end);
/* quant32_q8_pack.c: gguf_q8_repack of a 32-weight type */
int q32_repack(const uint8_t *blocks, uint8_t *packed, int64_t N, int64_t K, int kind, int threads);
/* quant32_q8.c, per ISA as kquant_q8.c: rows to Q8_0 / Q8_1, and the column groups of a q8_job whose kind is
 * a 32-weight type (q8_range hands them over) */
void q8_0_quantize_512(const float *x, int8_t *qx, float *qd, float *qs, int16_t *qa, int64_t M, int64_t K);
void q8_0_quantize_256(const float *x, int8_t *qx, float *qd, float *qs, int16_t *qa, int64_t M, int64_t K);
void q32_range_512(const void *job, int64_t begin, int64_t end);
void q32_range_256(const void *job, int64_t begin, int64_t end);

/* ======== AMX (kquant_amx.c) ======== */
/* Rows from which a Q4_K or Q6_K q8_job runs on AMX tiles, 0 when they are off (set by kernels_amx). */
extern int q8_amx;
/* Column groups [begin, end) of a Q4_K or Q6_K q8_job on AMX tiles, bitwise q8_range_512's: 0, or -1 for another
 * kind or when scratch memory ran out (nothing written then). */
int q8_amx_range(const q8_job *job, int64_t begin, int64_t end);

/* ======== one ISA whatever the caller's ======== */
/* kquant.c (AVX2+FMA): exact k-quant rows widened to float32 */
typedef void (*widen_fn)(const void *w, const float *s, int64_t K, int rows, int64_t k0, int64_t k1, float *out, int ahead);
void widen_q4k(const void *w, const float *sm, int64_t K, int rows, int64_t k0, int64_t k1, float *out, int ahead);
void widen_q6k(const void *w, const float *s, int64_t K, int rows, int64_t k0, int64_t k1, float *out, int ahead);
/* int4_vnni.c (AVX-512 VNNI) and int4_avx2.c (AVX2): int4 weights x int8-rounded activations.
 * 1 on success, 0 when scratch memory ran out. */
int linear_vnni_group(const float *x, int count, const uint8_t *const *w, const float *const *s, const float *const *b,
                      float *const *y, const int64_t *N, int64_t M, int64_t K, int threads);
int linear_q8avx2(const float *x, int count, const uint8_t *const *w, const float *const *s, const float *const *b,
                  float *const *y, const int64_t *N, int64_t M, int64_t K, int threads);
/* panels.c (AVX2+FMA). 0, or -1 when scratch memory is short. */
int panel_linear_group(const float *x, int count, const void *const *w, const float *const *b, float *const *y,
                       const int64_t *N, int64_t M, int64_t K, int threads);

#endif
