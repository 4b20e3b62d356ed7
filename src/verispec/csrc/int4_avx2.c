/* ======== int4 weights x int8 activations on AVX2 ========
 * The arithmetic of the VNNI path above with AVX2's byte products: the activations are rounded to
 * int8 per group of I4GROUP the same way; vpmaddubsw multiplies 32 weight nibbles (unsigned) by 32
 * activation bytes into 16 int16 pair sums (at most 2 * 15 * 127, no saturation), the group's two
 * halves are added (at most 4 * 15 * 127) and vpmaddwd folds pairs into 8 int32 lanes, started from
 * -8 * the lanes' activation sums: lane l holds sum (q - 8) * x over weights 4l..4l+3 and
 * 32+4l..32+4l+3, exactly. About a third of the instructions of unpacking nibbles to float, which
 * leaves a 4-bit draft bound by memory instead of arithmetic on an AVX2 core.
 * qc holds 8 int32 starting lanes per row and group; qx and qs as in int4_int8.h.
 * (AVX2+FMA, whatever the caller's ISA.) */
#include "int4_int8.h"
#include "simd_avx2.h"

static inline __m256i q8lanes_avx2(__m256i start, __m256i wlo, __m256i whi, const int8_t *x)
{
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(wlo, _mm256_loadu_si256((const __m256i *)x)),
                                           _mm256_maddubs_epi16(whi, _mm256_loadu_si256((const __m256i *)(x + 32))));
    return _mm256_add_epi32(start, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* activation rows -> int8 per group (bitwise the VNNI path's rounding: x * (127 / amax), nearest even) */
static void quantize_rows_avx2(const float *x, int8_t *qx, float *qs, int32_t *qc, int64_t M, int64_t K)
{
    const int64_t groups = K / I4GROUP;
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + m * K + g * I4GROUP;
            float amax = 0.0f;
            for (int c = 0; c < I4GROUP; c++) amax = fmaxf(amax, fabsf(xg[c]));
            const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = qx + m * K + g * I4GROUP;
            for (int c = 0; c < I4GROUP; c++) {
                const float r = nearbyintf(xg[c] * inverse);
                q[c] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            }
            qs[m * groups + g] = amax / 127.0f;
            const __m256i sums = q8lanes_avx2(_mm256_setzero_si256(), ones, ones, q);
            _mm256_storeu_si256((__m256i *)(qc + (m * groups + g) * 8), _mm256_mullo_epi32(sums, _mm256_set1_epi32(-8)));
        }
}

/* A tile: activation rows m0..m0+mr-1 (mr <= Q8ROWS) against NR weight rows, over all groups; the
 * sums go to y[i * ldy + j] for tile row i and weight row j. Each weight row is unpacked and used
 * by every tile row before the next is loaded, so accumulators, one row's nibbles and temporaries
 * fit AVX2's 16 registers; the row count is a constant in each instance (a runtime count would
 * index the accumulators in memory: a store and a load per multiply-add). */
#define Q8ROWS 2
__attribute__((always_inline)) static inline void tile_q8avx2_rows(
    const vnni_job *job, int64_t m0, const int mr, const uint8_t *w, const float *s, float *y, int64_t ldy, const char *next)
{
    const int64_t K = job->K, row_bytes = K / 2, groups = K / I4GROUP;
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc[Q8ROWS][NR];
    for (int i = 0; i < Q8ROWS; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + j * row_bytes + g * (I4GROUP / 2)));
            if (next) _mm_prefetch(next + j * row_bytes + g * (I4GROUP / 2), _MM_HINT_T0);
            const __m256i wlo = _mm256_and_si256(bytes, low), whi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            const float sw = s[j * groups + g];
            _Pragma("GCC unroll 2") for (int i = 0; i < mr; i++) {
                const int64_t m = m0 + i;
                const __m256i start = _mm256_loadu_si256((const __m256i *)(job->qc + (m * groups + g) * 8));
                const __m256i lanes = q8lanes_avx2(start, wlo, whi, job->qx + m * K + g * I4GROUP);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(sw * job->qs[m * groups + g]), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) y[i * ldy + j] = hsum256(acc[i][j]);
}

static void tile_q8avx2(const vnni_job *job, int64_t m0, int mr, const uint8_t *w, const float *s, float *y, int64_t ldy,
                        const char *next)
{
    if (mr == 1) tile_q8avx2_rows(job, m0, 1, w, s, y, ldy, next);
    else tile_q8avx2_rows(job, m0, 2, w, s, y, ldy, next);
}

/* Weight-row tiles [begin, end) of an AVX2 int8-activation job; the bias is added after the sum. */
static void linear_range_q8avx2(const void *arg, int64_t begin, int64_t end)
{
    const vnni_job *job = arg;
    const int64_t K = job->K, groups = K / I4GROUP;
    for (int64_t t = begin; t < end; t++) {
        const uint8_t *w = job->w + t * NR * (K / 2);
        const char *next = t + 1 < end ? (const char *)(w + NR * (K / 2)) : 0;
        for (int64_t m0 = 0; m0 < job->M; m0 += Q8ROWS) {
            const int mr = job->M - m0 < Q8ROWS ? (int)(job->M - m0) : Q8ROWS;
            tile_q8avx2(job, m0, mr, w, job->s + t * NR * groups, job->y + m0 * job->N + t * NR, job->N, m0 == 0 ? next : 0);
        }
        if (job->b)
            for (int64_t m = 0; m < job->M; m++)
                for (int j = 0; j < NR; j++) job->y[m * job->N + t * NR + j] += job->b[t * NR + j];
    }
}

/* The same on AVX2 (quantize_rows_avx2, vpmaddubsw). 0 when the scratch memory ran out. The last N % NR
 * weight rows run as a tile of NR whose extra rows repeat the last one (each output is a function of its
 * own weight row: nothing else changes). */
int linear_q8avx2(const float *x, int count, const uint8_t *const *w, const float *const *s, const float *const *b,
                         float *const *y, const int64_t *N, int64_t M, int64_t K, int threads)
{
    const int64_t groups = K / I4GROUP;
    vnni_job jobs[MAX_GROUP];
    int64_t tiles[MAX_GROUP] = {0};
    int8_t *qx = int4_group_run(quantize_rows_avx2, 8, linear_range_q8avx2, jobs, tiles, x, count, w, s, b, y, N, M, K, threads);
    if (!qx) return 0;
    for (int i = 0; i < count; i++)
        for (int64_t n = tiles[i] * NR; n < N[i]; n++) {  /* the edge: one weight row at a time, same arithmetic */
            float out[Q8ROWS * NR];
            uint8_t *packed = malloc((size_t)(NR * (K / 2)));
            float *scales = malloc(sizeof(float) * (size_t)(NR * groups));
            if (!packed || !scales) { free(packed); free(scales); free(qx); return 0; }
            for (int j = 0; j < NR; j++) {
                memcpy(packed + j * (K / 2), w[i] + n * (K / 2), (size_t)(K / 2));
                memcpy(scales + j * groups, s[i] + n * groups, sizeof(float) * (size_t)groups);
            }
            for (int64_t m0 = 0; m0 < M; m0 += Q8ROWS) {
                const int mr = M - m0 < Q8ROWS ? (int)(M - m0) : Q8ROWS;
                tile_q8avx2(&jobs[i], m0, mr, packed, scales, out, NR, 0);
                for (int r = 0; r < mr; r++) y[i][(m0 + r) * N[i] + n] = out[r * NR] + (b[i] ? b[i][n] : 0.0f);
            }
            free(packed); free(scales);
        }
    free(qx);
    return 1;
}
