/* ======== exact k-quant weights: widen a block, then the float32 tiles on it ========
 * (a vector source: compiled once per ISA, see simd.h)
 * The same tiles, blocks, row passes and final reduction as linear_range_f32, on weights rebuilt
 * exactly (kquant.c): every output is bitwise what the float32 matrix gives, from a fifth to a third
 * of its bytes. Both formats keep K / 16 floats of scales per row.
 * For one or two activation rows (a decode step) the weights are rebuilt in registers instead, fed
 * straight to the same fused multiply-adds in the same k order: the float32 tile's arithmetic again,
 * with no scratch round trip. */
#include "common.h"
#include "simd.h"

#define FUSED(MR)                                                                                  \
static void fused_q4k_##MR(const float *x, const uint8_t *w, const float *sm, VEC *saved, int64_t K, int ahead) \
{                                                                                                 \
    VEC acc[MR][NR];                                                                              \
    _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = VZERO();                \
    for (int64_t g = 0; g < K / 64; g++) {                                                        \
        if (ahead && g % 2 == 0) _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {          \
            _mm_prefetch((const char *)(w + (NR + j) * (K / 2) + g * 32), _MM_HINT_T0);          \
            if (g % 4 == 0) _mm_prefetch((const char *)(sm + (NR + j) * (K / 16) + 4 * g), _MM_HINT_T0); \
        }                                                                                         \
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {                           \
            VEC scale[NR], low[NR];                                                               \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                               \
                scale[j] = VSET1(sm[j * (K / 16) + 4 * g + 2 * half]);                            \
                low[j] = VSET1(sm[j * (K / 16) + 4 * g + 2 * half + 1]);                          \
            }                                                                                     \
            _Pragma("GCC unroll 4") for (int c = 0; c < 32; c += LANES) {                        \
                VEC wv[NR];                                                                       \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                             \
                    wv[j] = Q4KWEIGHTS(w + j * (K / 2) + g * 32 + c, 4 * half, scale[j], low[j]); \
                _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) {                           \
                    const VEC xv = VLOAD(x + i * K + g * 64 + half * 32 + c);                     \
                    _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}                                                                                                 \
static void fused_q6k_##MR(const float *x, const uint8_t *w, const float *s, VEC *saved, int64_t K, int ahead) \
{                                                                                                 \
    VEC acc[MR][NR];                                                                              \
    _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = VZERO();                \
    for (int64_t g = 0; g < K / 16; g++) {                                                        \
        if (ahead && g % 4 == 0) _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {          \
            _mm_prefetch((const char *)(w + (NR + j) * K + g * 16), _MM_HINT_T0);                \
            if (g % 16 == 0) _mm_prefetch((const char *)(s + (NR + j) * (K / 16) + g), _MM_HINT_T0); \
        }                                                                                         \
        VEC scale[NR];                                                                            \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) scale[j] = VSET1(s[j * (K / 16) + g]); \
        _Pragma("GCC unroll 2") for (int c = 0; c < 16; c += LANES) {                            \
            VEC wv[NR];                                                                           \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                 \
                wv[j] = Q6KWEIGHTS((const int8_t *)w + j * K + g * 16 + c, scale[j]);             \
            _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) {                               \
                const VEC xv = VLOAD(x + i * K + g * 16 + c);                                     \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]); \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}
FUSED(1) FUSED(2)

/* MR activation rows x the NR widened weight rows over k in [k0, k1), continuing `saved`: the float32
 * tile's per-output arithmetic (one accumulator vector fed in k order), with the MR rows of x held in
 * registers and one weight vector loaded at a time, so MR x NR accumulators fit (3 x 4 on AVX2). */
#define WIDE(MR)                                                                                   \
static void widetile_##MR(const float *x, const float *w, VEC *saved, int64_t k0, int64_t k1, int64_t K) \
{                                                                                                 \
    VEC acc[MR][NR];                                                                              \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = k0 ? saved[i * NR + j] : VZERO(); \
    for (int64_t k = k0; k < k1; k += LANES) {                                                    \
        VEC xv[MR];                                                                               \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) xv[i] = VLOAD(x + i * K + k);       \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                   \
            const VEC wv = VLOAD(w + j * K + k);                                                  \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) acc[i][j] = VFMA(xv[i], wv, acc[i][j]); \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}
WIDE(1) WIDE(2) WIDE(3)
#if MAXMR > 3
WIDE(4) WIDE(5) WIDE(6)
#endif
typedef void (*widetile_fn)(const float *, const float *, VEC *, int64_t, int64_t, int64_t);
#if MAXMR > 3
static const widetile_fn widetiles[7] = {0, widetile_1, widetile_2, widetile_3, widetile_4, widetile_5, widetile_6};
#else
static const widetile_fn widetiles[4] = {0, widetile_1, widetile_2, widetile_3};
#endif
typedef void (*fused_fn)(const float *, const uint8_t *, const float *, VEC *, int64_t, int);
#define FUSED_ROWS 2  /* activation rows up to which the weights are rebuilt in registers */

static void linear_range_widened(const linear_job *job, int64_t begin, int64_t end, widen_fn widen, int64_t row_bytes,
                                 const fused_fn *fused)
{
    const int64_t M = job->M, N = job->N, K = job->K;
    VEC local[64 * NR];
    VEC *saved = M <= 64 ? local : aligned_alloc(64, sizeof(VEC) * (size_t)(M * NR));
    float *wide = M <= FUSED_ROWS ? 0 : aligned_alloc(64, sizeof(float) * (size_t)(NR * K));  /* K: a multiple of 256 */
    for (int64_t t = begin; t < end; t++) {
        const char *w = (const char *)job->w + t * NR * row_bytes;
        const float *s = job->s + t * NR * (K / 16);
        if (M <= FUSED_ROWS) fused[M](job->x, (const uint8_t *)w, s, saved, K, t + 1 < end);
        else for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
            const int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
            widen(w, s, K, NR, k0, k1, wide, t + 1 < end ? NR : 0);
            /* rows in passes of at most MAXMR, split evenly: the widened weights are in L1 */
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t passes = (M - m0 + MAXMR - 1) / MAXMR;
                const int mr = (int)((M - m0 + passes - 1) / passes);
                widetiles[mr](job->x + m0 * K, wide, saved + m0 * NR, k0, k1, K);
                m0 += mr;
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < NR; j++)
                job->y[m * N + t * NR + j] = VHSUM(saved[m * NR + j]) + (job->b ? job->b[t * NR + j] : 0.0f);
    }
    free(wide);
    if (saved != local) free(saved);
}

void VS_FN(linear_range_q4k)(const void *arg, int64_t begin, int64_t end)
{
    static const fused_fn fused[3] = {0, fused_q4k_1, fused_q4k_2};
    linear_range_widened(arg, begin, end, widen_q4k, ((const linear_job *)arg)->K / 2, fused);
}

void VS_FN(linear_range_q6k)(const void *arg, int64_t begin, int64_t end)
{
    static const fused_fn fused[3] = {0, fused_q6k_1, fused_q6k_2};
    linear_range_widened(arg, begin, end, widen_q6k, ((const linear_job *)arg)->K, fused);
}
