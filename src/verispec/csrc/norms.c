/* ======== RMSNorm and SwiGLU's product, the elementwise glue between the products ========
 * (a vector source: compiled once per ISA, see simd.h) */
#include "common.h"
#include "simd.h"
#include "vexp.h"

/* gate <- silu(gate) * up = gate / (1 + e^-gate) * up, elementwise over n floats. */
void VS_FN(silu_mul_isa)(float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i += LANES) {
        const int64_t left = n - i < LANES ? n - i : LANES;
        const VEC g = VLOADN(gate + i, left), u = VLOADN(up + i, left);
        const VEC silu = VDIV(g, VADD(VSET1(1.0f), vexp(VSUB(VZERO(), g))));
        VSTOREN(gate + i, VMUL(silu, u), left);
    }
}

/* RMSNorm (Zhang & Sennrich 2019) of each row of x [M, D]: out = w * (x / sqrt(mean(x^2) + eps)).
 * With delta, first x += delta (the residual connection), in place. Squares are summed in lanes
 * d mod L along the row, then a fixed reduction: independent of M. */
void VS_FN(rms_norm_isa)(float *x, const float *delta, const float *w, float *out, int64_t M, int64_t D, float eps)
{
    for (int64_t m = 0; m < M; m++) {
        float *row = x + m * D;
        if (delta)
            for (int64_t d = 0; d < D; d++) row[d] = row[d] + delta[m * D + d];
        VEC acc = VZERO();
        for (int64_t d = 0; d < D; d += LANES) {
            const VEC v = VLOADN(row + d, D - d < LANES ? D - d : LANES);
            acc = VADD(acc, VMUL(v, v));
        }
        const float scale = 1.0f / sqrtf(VHSUM(acc) / (float)D + eps);
        for (int64_t d = 0; d < D; d++) out[m * D + d] = w[d] * (row[d] * scale);
    }
}
