/* ======== int4 weights x int8 activations on AVX-512 VNNI ========
 * The same int4 matrices, four times fewer instructions than unpacking to float: each activation
 * row is rounded to int8 per group of I4GROUP (scale = max|x| / 127, round to nearest even), and
 * one vpdpbusd multiplies 64 weight nibbles (0..15, unsigned) by 64 activation bytes into 16
 * int32 lanes, started from -8 * the lanes' activation sums so the lanes hold sum (q - 8) * x
 * exactly. A group then adds float(lanes) * (weight scale * activation scale) to the row's float
 * accumulator, in group order. Rounding x depends on x's own row only: rows stay independent.
 * qc holds 16 int32 starting lanes per row and group (see int4_int8.h).
 * (AVX-512F, BW and VNNI, whatever the caller's ISA.) */
#include "int4_int8.h"

static void quantize_rows_vnni(const float *x, int8_t *qx, float *qs, int32_t *qc, int64_t M, int64_t K)
{
    const int64_t groups = K / I4GROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + m * K + g * I4GROUP;
            __m512 peak = _mm512_setzero_ps();
            for (int c = 0; c < I4GROUP; c += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(xg + c)));
            const float amax = _mm512_reduce_max_ps(peak), scale = amax / 127.0f;
            const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            int8_t *q = qx + m * K + g * I4GROUP;
            for (int c = 0; c < I4GROUP; c += 16)
                _mm_storeu_si128((__m128i *)(q + c), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + c), inverse))));
            qs[m * groups + g] = scale;
            const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_loadu_si512(q));
            _mm512_storeu_si512(qc + (m * groups + g) * 16, _mm512_mullo_epi32(sums, _mm512_set1_epi32(-8)));
        }
}

/* A group's 64 weight nibbles (32 bytes, layout as above) as 64 unsigned bytes in weight order. */
static inline __m512i nibbles_vnni(const uint8_t *p)
{
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)p), low = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low)),
                              _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low), 1);
}

#define TILE_VNNI(MR)                                                                              \
static void tile_vnni_##MR(                                                                       \
    const vnni_job *job, int64_t m0, const uint8_t *w, const float *s, __m512 *saved, int64_t g0, int64_t g1, const char *next) \
{                                                                                                 \
    const int64_t K = job->K, row_bytes = K / 2, groups = K / I4GROUP;                            \
    __m512 acc[MR][NR];                                                                           \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = g0 ? saved[i * NR + j] : _mm512_setzero_ps(); \
    for (int64_t g = g0; g < g1; g++) {                                                           \
        __m512i wv[NR];                                                                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                   \
            if (next) _mm_prefetch(next + j * row_bytes + g * (I4GROUP / 2), _MM_HINT_T0);        \
            wv[j] = nibbles_vnni(w + j * row_bytes + g * (I4GROUP / 2));                          \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                   \
            const int64_t m = m0 + i;                                                             \
            const __m512i xv = _mm512_loadu_si512(job->qx + m * K + g * I4GROUP);                 \
            const __m512i start = _mm512_loadu_si512(job->qc + (m * groups + g) * 16);            \
            const float xs = job->qs[m * groups + g];                                             \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                               \
                const __m512i lanes = _mm512_dpbusd_epi32(start, wv[j], xv);                      \
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_set1_ps(s[j * groups + g] * xs), acc[i][j]); \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}
TILE_VNNI(1) TILE_VNNI(2) TILE_VNNI(3) TILE_VNNI(4) TILE_VNNI(5) TILE_VNNI(6)
typedef void (*tile_vnni_fn)(const vnni_job *, int64_t, const uint8_t *, const float *, __m512 *, int64_t, int64_t, const char *);
static const tile_vnni_fn tiles_vnni[7] = {0, tile_vnni_1, tile_vnni_2, tile_vnni_3, tile_vnni_4, tile_vnni_5, tile_vnni_6};

/* Weight-row tiles [begin, end) of a vnni_job; a last partial tile (N % 4 rows) is padded with a
 * repeat of its last row, whose results are dropped: rows never mix, so nothing else changes. */
static void linear_range_vnni(const void *arg, int64_t begin, int64_t end)
{
    const vnni_job *job = arg;
    /* k blocks keep a block's activation rows in L1 while the row tiles pass over it; a pass of one
     * tile of rows (M <= 6, a decode or draft step) holds them there anyway, and runs whole rows: the
     * same sums in the same order, without saving and reloading the accumulators every block */
    const int64_t M = job->M, N = job->N, K = job->K, groups = K / I4GROUP, gblock = M <= 6 ? groups : KBLOCK / I4GROUP;
    __m512 local[64 * NR];
    __m512 *saved = M <= 64 ? local : aligned_alloc(64, sizeof(__m512) * (size_t)(M * NR));
    for (int64_t t = begin; t < end; t++) {
        const uint8_t *w = job->w + t * NR * (K / 2);
        const float *s = job->s + t * NR * groups;
        for (int64_t g0 = 0; g0 < groups; g0 += gblock) {
            const int64_t g1 = g0 + gblock < groups ? g0 + gblock : groups;
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t passes = (M - m0 + 5) / 6;
                const int mr = (int)((M - m0 + passes - 1) / passes);
                const char *next = m0 == 0 && t + 1 < end ? (const char *)(w + NR * (K / 2)) : 0;
                tiles_vnni[mr](job, m0, w, s, saved + m0 * NR, g0, g1, next);
                m0 += mr;
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < NR; j++)
                job->y[m * N + t * NR + j] = _mm512_reduce_add_ps(saved[m * NR + j]) + (job->b ? job->b[t * NR + j] : 0.0f);
    }
    if (saved != local) free(saved);
}

/* The last N % 4 weight rows, one at a time, with the arithmetic of a tile. */
static void edge_vnni(const vnni_job *job, int64_t n)
{
    const int64_t K = job->K, groups = K / I4GROUP;
    for (int64_t m = 0; m < job->M; m++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const __m512i wv = nibbles_vnni(job->w + n * (K / 2) + g * (I4GROUP / 2));
            const __m512i lanes = _mm512_dpbusd_epi32(_mm512_loadu_si512(job->qc + (m * groups + g) * 16), wv,
                                                      _mm512_loadu_si512(job->qx + m * K + g * I4GROUP));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_set1_ps(job->s[n * groups + g] * job->qs[m * groups + g]), acc);
        }
        job->y[m * job->N + n] = _mm512_reduce_add_ps(acc) + (job->b ? job->b[n] : 0.0f);
    }
}

/* int4 products on AVX-512 VNNI (activations rounded by quantize_rows_vnni), a group as one job; each
 * output is bitwise what the product alone gives. 0 when the scratch memory ran out. */
int linear_vnni_group(const float *x, int count, const uint8_t *const *w, const float *const *s, const float *const *b,
                             float *const *y, const int64_t *N, int64_t M, int64_t K, int threads)
{
    vnni_job jobs[MAX_GROUP];
    int64_t tiles[MAX_GROUP] = {0};
    int8_t *qx = int4_group_run(quantize_rows_vnni, 16, linear_range_vnni, jobs, tiles, x, count, w, s, b, y, N, M, K, threads);
    if (!qx) return 0;
    for (int i = 0; i < count; i++)
        for (int64_t n = tiles[i] * NR; n < N[i]; n++) edge_vnni(&jobs[i], n);
    free(qx);
    return 1;
}
