/* ======== int4 linear: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) with 4-bit weights ========
 * (a vector source: compiled once per ISA, see simd.h)
 * w [N, K / 2] bytes in groups of I4GROUP weights along k (32 bytes each): byte j of a group holds
 * weight j in its low nibble and weight j + 32 in its high one, as q + 8 (q in [-8, 7]); the
 * weight is q * s[n, k / I4GROUP]. Exactness as for the other formats: every y[m, n] owns one
 * accumulator fed, per group and per chunk of L bytes, x * (low weights) then x * (high weights),
 * in k order of the chunks; tiles only decide which accumulators are live together. */
#include "common.h"
#include "simd.h"

typedef void (*tile_i4_fn)(const float *, const uint8_t *, const float *, VEC *, int64_t, int64_t, int64_t, const char *);
#define TILE_I4(MR)                                                                                \
static void tile_i4_##MR(                                                                          \
    const float *x, const uint8_t *w, const float *s, VEC *saved, int64_t g0, int64_t g1, int64_t K, const char *next) \
{                                                                                                 \
    const int64_t row_bytes = K / 2, row_groups = K / I4GROUP;                                    \
    VEC acc[MR][NR];                                                                              \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = g0 ? saved[i * NR + j] : VZERO(); \
    for (int64_t g = g0; g < g1; g++) {                                                           \
        VEC table[NR];                                                                            \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                   \
            table[j] = I4TABLE(s[j * row_groups + g]);                                            \
            if (next) _mm_prefetch(next + j * row_bytes + g * (I4GROUP / 2), _MM_HINT_T0);        \
        }                                                                                         \
        _Pragma("GCC unroll 4") for (int c = 0; c < I4GROUP / 2; c += LANES) {                   \
            VEC lo[NR], hi[NR];                                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                 \
                I4UNPACK(w + j * row_bytes + g * (I4GROUP / 2) + c, table[j], &lo[j], &hi[j]);    \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                               \
                const float *xg = x + i * K + g * I4GROUP + c;                                    \
                const VEC xl = VLOAD(xg), xh = VLOAD(xg + I4GROUP / 2);                           \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                           \
                    acc[i][j] = VFMA(xl, lo[j], acc[i][j]);                                       \
                    acc[i][j] = VFMA(xh, hi[j], acc[i][j]);                                       \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}
TILE_I4(1) TILE_I4(2) TILE_I4(3)
#if MAXMR > 3
TILE_I4(4) TILE_I4(5) TILE_I4(6)
static const tile_i4_fn tiles_i4[7] = {0, tile_i4_1, tile_i4_2, tile_i4_3, tile_i4_4, tile_i4_5, tile_i4_6};
#else
static const tile_i4_fn tiles_i4[4] = {0, tile_i4_1, tile_i4_2, tile_i4_3};
#endif

/* Weight-row tiles [begin, end) of an int4 linear_job (the last N % 4 rows run as tiles of their own
 * rows by `edge`), groups in blocks so the activation rows stay in cache, as for the other formats. */
void VS_FN(linear_range_i4)(const void *arg, int64_t begin, int64_t end)
{
    const linear_job *job = arg;
    const int64_t M = job->M, N = job->N, K = job->K, groups = K / I4GROUP, gblock = KBLOCK / I4GROUP;
    VEC local[64 * NR];
    VEC *saved = M <= 64 ? local : aligned_alloc(64, sizeof(VEC) * (size_t)(M * NR));
    for (int64_t t = begin; t < end; t++) {
        const uint8_t *w = (const uint8_t *)job->w + t * NR * (K / 2);
        const float *s = job->s + t * NR * groups;
        for (int64_t g0 = 0; g0 < groups; g0 += gblock) {
            const int64_t g1 = g0 + gblock < groups ? g0 + gblock : groups;
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t passes = (M - m0 + MAXMR - 1) / MAXMR;
                const int mr = (int)((M - m0 + passes - 1) / passes);
                const char *next = m0 == 0 && t + 1 < end ? (const char *)(w + NR * (K / 2)) : 0;
                tiles_i4[mr](job->x + m0 * K, w, s, saved + m0 * NR, g0, g1, K, next);
                m0 += mr;
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < NR; j++)
                job->y[m * N + t * NR + j] = VHSUM(saved[m * NR + j]) + (job->b ? job->b[t * NR + j] : 0.0f);
    }
    if (saved != local) free(saved);
}

/* The last N % 4 weight rows, one at a time: the same per-element arithmetic as a tile. */
void VS_FN(linear_edge_i4)(const float *x, const uint8_t *w, const float *s, const float *b, float *y,
                           int64_t M, int64_t N, int64_t K)
{
    for (int64_t i = 0; i < M; i++) {
        VEC acc = VZERO();
        for (int64_t g = 0; g < K / I4GROUP; g++) {
            const VEC table = I4TABLE(s[g]);
            for (int c = 0; c < I4GROUP / 2; c += LANES) {
                VEC lo, hi;
                I4UNPACK(w + g * (I4GROUP / 2) + c, table, &lo, &hi);
                const float *xg = x + i * K + g * I4GROUP + c;
                acc = VFMA(VLOAD(xg), lo, acc);
                acc = VFMA(VLOAD(xg + I4GROUP / 2), hi, acc);
            }
        }
        y[i * N] = VHSUM(acc) + (b ? b[0] : 0.0f);
    }
}

/* ======== grouped int4 quantization (`Int4Matrix.quantize`) ========
 * For each group of 64 weights, of the scales peak * shrink / 7 (shrinks[0..count)), the one with
 * the least squared rounding error (the first of equals), then the codes q + 8 packed two to a byte
 * (low nibble: weight i, high: weight i + 32). The same float32 operations as the PyTorch reference,
 * but a group stays in registers instead of every candidate streaming the whole matrix through
 * memory (a 1.5B model: ~90 s -> a few seconds). Each weight's code is x * (1 / scale) (the float32
 * reciprocal: a multiply is cheaper than a division) rounded to nearest even and clamped to [-8, 7].
 * Per lane the operations of the PyTorch reference: the code; the error q * s - x; r * r added to the
 * lane's sum for i = 0, 16, 32, 48; then the 16 lane sums added in order, so either ISA picks the
 * same scale. Rows [begin, end) of a quantize_job. */
void VS_FN(int4_quantize_rows)(const void *arg, int64_t begin, int64_t end)
{
    const quantize_job *job = arg;
    const int64_t groups = job->K / 64;
    const int count = job->count;
    if (count < 1 || count > I4MAXSHRINKS) return;  /* int4_quantize refuses such counts */
    const VEC low = VSET1(-8.0f), high = VSET1(7.0f);
    for (int64_t g = begin * groups; g < end * groups; g++) {
        const float *x = job->w + g * 64;
        VEC most = VZERO();  /* the largest |x| per lane: max(x, -x) */
        for (int i = 0; i < 64; i += LANES) {
            const VEC xv = VLOAD(x + i);
            most = VMAX(most, VMAX(xv, VSUB(VZERO(), xv)));
        }
        float lanes[LANES], peak = 0.0f;
        VSTORE(lanes, most);
        for (int j = 0; j < LANES; j++) peak = lanes[j] > peak ? lanes[j] : peak;
        if (peak < 1e-12f) peak = 1e-12f;
        float candidates[I4MAXSHRINKS], sums[I4MAXSHRINKS][16], errors[I4MAXSHRINKS];
        for (int c = 0; c < count; c++) {
            candidates[c] = peak * job->shrinks[c] / 7.0f;
            const VEC scale = VSET1(candidates[c]), inverse = VSET1(1.0f / candidates[c]);
            for (int v = 0; v < 16 / LANES; v++) {
                VEC sum = VZERO();
                for (int i = 0; i < 64; i += 16) {
                    const VEC xv = VLOAD(x + i + v * LANES);
                    const VEC q = VMIN(VMAX(VROUND(VMUL(xv, inverse)), low), high);
                    const VEC r = VSUB(VMUL(q, scale), xv);
                    sum = VADD(sum, VMUL(r, r));
                }
                VSTORE(sums[c] + v * LANES, sum);
            }
            errors[c] = 0.0f;
        }
        /* each candidate's lane sums added in order; the candidates side by side, as independent chains */
        for (int j = 0; j < 16; j++)
            for (int c = 0; c < count; c++) errors[c] += sums[c][j];
        float best_scale = candidates[0], best_error = errors[0];
        for (int c = 1; c < count; c++)
            if (errors[c] < best_error) { best_scale = candidates[c]; best_error = errors[c]; }
        const VEC inverse = VSET1(1.0f / best_scale);
        float codes[64];
        for (int i = 0; i < 64; i += LANES)
            VSTORE(codes + i, VMIN(VMAX(VROUND(VMUL(VLOAD(x + i), inverse)), low), high));
        uint8_t *out = job->packed + g * 32;
        for (int i = 0; i < 32; i++) out[i] = (uint8_t)(((int)codes[i] + 8) | (((int)codes[i + 32] + 8) << 4));
        job->scale[g] = best_scale;
    }
}
