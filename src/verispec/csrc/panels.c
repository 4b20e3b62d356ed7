/* ======== float32 matrices in 16-row panels (`PanelMatrix`), AVX2+FMA whatever the caller's ISA ========
 * w is stored [ceil(N / 16)][K][16]: for each k, 16 output rows' weights side by side, so a pass
 * reads the matrix as one contiguous stream (the hardware prefetcher follows it at full speed) and
 * a tile broadcasts x[m, k] against two 8-wide weight vectors (the GEMM microkernel's shape). Each
 * y[m, n] is the blocked GEMM's chain: per block of PKC k, one lane summing x[m, k] * w[n, k] by
 * fused multiply-adds in k order from 0; y = (b[n] or 0) + block 0, then y += each next block. Which
 * tile ran (how many rows, one panel or two) only decides which lanes were live together: a row's
 * result is bitwise the same for any M and any other rows, and the same as blocked_linear_group's
 * (a prefill). K needs no multiple of 8 and no tail. Rows past 6 go in further passes over the same
 * k block of the panel, now in L1, while the next block is prefetched. */
#include "common.h"  /* PNR: output rows per panel; PKC: k per block, the GEMM's GKC, for the same sums */
#define PMR 6      /* activation rows per pass */

#define PANEL_TILE(MR, P)                                                                          \
static void panel_tile_##MR##x##P(                                                                 \
    const float *x, int64_t K, const float *wp, int64_t kc, float *acc, const float *base, int fetch) \
{   /* rows [0, MR) of x (stride K) against P panels (stride K * 16) over kc k; acc [MR][P * 16] +=  \
     * the block's sums, or = base [P * 16] (bias or zeros) + them for the first block; `fetch`:     \
     * prefetch the next k block meanwhile */                                                     \
    __m256 a[MR][2 * P];                                                                          \
    _Pragma("GCC unroll 6") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < 2 * P; j++) a[i][j] = _mm256_setzero_ps();   \
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < kc; k++) {                                   \
        __m256 w[2 * P];                                                                          \
        _Pragma("GCC unroll 4") for (int j = 0; j < 2 * P; j++)                                  \
            w[j] = _mm256_load_ps(wp + (j / 2) * K * PNR + k * PNR + (j % 2) * 8);               \
        if (fetch)                                                                                \
            _Pragma("GCC unroll 2") for (int j = 0; j < P; j++)                                  \
                _mm_prefetch((const char *)(wp + j * K * PNR + (kc + k) * PNR), _MM_HINT_T0);     \
        _Pragma("GCC unroll 6") for (int i = 0; i < MR; i++) {                                   \
            const __m256 xv = _mm256_broadcast_ss(x + i * K + k);                                 \
            _Pragma("GCC unroll 4") for (int j = 0; j < 2 * P; j++) a[i][j] = _mm256_fmadd_ps(xv, w[j], a[i][j]); \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 6") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < 2 * P; j++) {                                \
            float *out = acc + i * P * PNR + j * 8;                                               \
            _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(base ? base + j * 8 : out), a[i][j])); \
        }                                                                                         \
}
PANEL_TILE(1, 1) PANEL_TILE(2, 1) PANEL_TILE(3, 1) PANEL_TILE(4, 1) PANEL_TILE(5, 1) PANEL_TILE(6, 1)
PANEL_TILE(1, 2) PANEL_TILE(2, 2)  /* one or two rows: two panels at once, for 4-8 independent FMA chains */
typedef void (*panel_tile_fn)(const float *, int64_t, const float *, int64_t, float *, const float *, int);
static const panel_tile_fn panel_tiles[PMR + 1] = {0, panel_tile_1x1, panel_tile_2x1, panel_tile_3x1, panel_tile_4x1,
                                                   panel_tile_5x1, panel_tile_6x1};

typedef struct {
    const float *x; int64_t M, K; int count;
    const float *w[MAX_GROUP]; const float *b[MAX_GROUP]; float *y[MAX_GROUP]; int64_t N[MAX_GROUP];
    int64_t first[MAX_GROUP + 1];  /* panels of the parts before each */
} panel_job;

/* Panels [p, p + P) of one part: acc [M][P * 16], then y for the rows that exist. */
static void panel_run(const panel_job *job, int part, int64_t p, int P, float *acc)
{
    const int64_t M = job->M, K = job->K, N = job->N[part];
    const float *w = job->w[part] + p * K * PNR, *b = job->b[part];
    float base[2 * PNR] __attribute__((aligned(32)));  /* the panels' bias, zero past N (or no bias) */
    for (int64_t j = 0; j < P * PNR; j++) base[j] = b && p * PNR + j < N ? b[p * PNR + j] : 0.0f;
    if (K == 0)
        for (int64_t m = 0; m < M; m++) memcpy(acc + m * P * PNR, base, sizeof(float) * (size_t)(P * PNR));
    for (int64_t k0 = 0; k0 < K; k0 += PKC) {
        const int64_t kc = K - k0 < PKC ? K - k0 : PKC;
        if (P == 2) {
            (M == 1 ? panel_tile_1x2 : panel_tile_2x2)(job->x + k0, K, w + k0 * PNR, kc, acc, k0 ? 0 : base, 0);
            continue;
        }
        for (int64_t m0 = 0; m0 < M;) {  /* rows split evenly over the fewest passes: 8 -> 4 + 4 */
            const int64_t passes = (M - m0 + PMR - 1) / PMR;
            const int mr = (int)((M - m0 + passes - 1) / passes);
            /* software prefetch paid off where the block is read more than once or by 5-6 rows, and
             * slowed 1-4 rows in one pass by 2-6% (2 Zen 3 cores): the hardware's own keeps up there */
            panel_tiles[mr](job->x + m0 * K + k0, K, w + k0 * PNR, kc, acc + m0 * PNR, k0 ? 0 : base, M > PMR || mr >= 5);
            m0 += mr;
        }
    }
    for (int q = 0; q < P; q++) {
        const int64_t n0 = (p + q) * PNR, cols = N - n0 < PNR ? N - n0 : PNR;
        for (int64_t m = 0; m < M; m++)
            memcpy(job->y[part] + m * N + n0, acc + m * P * PNR + q * PNR, sizeof(float) * (size_t)cols);
    }
}

/* Panels [begin, end) of the job, numbered across its parts in order. */
static void panel_range(const void *arg, int64_t begin, int64_t end)
{
    const panel_job *job = arg;
    float local[64 * 2 * PNR] __attribute__((aligned(32)));
    float *acc = job->M <= 64 ? local : aligned_alloc(32, sizeof(float) * (size_t)(job->M * 2 * PNR));
    if (!acc) return;  /* the caller checked the scratch it needs before the job (see panel_linear_group) */
    for (int i = 0; i < job->count; i++) {
        const int64_t lo = begin > job->first[i] ? begin : job->first[i];
        const int64_t hi = end < job->first[i + 1] ? end : job->first[i + 1];
        for (int64_t p = lo; p < hi;) {
            const int P = job->M <= 2 && p + 1 < hi ? 2 : 1;
            panel_run(job, i, p - job->first[i], P, acc);
            p += P;
        }
    }
    if (acc != local) free(acc);
}

/* y[i] = x w[i]^T (+ b[i]) for `count` panel matrices [N[i], K] sharing x [M, K]. Returns 0, or -1
 * when scratch memory is short. */
int panel_linear_group(const float *x, int count, const void *const *w, const float *const *b, float *const *y,
                              const int64_t *N, int64_t M, int64_t K, int threads)
{
    if (M > 64) {  /* each worker needs its own accumulators then: check that they can exist */
        void *probe = aligned_alloc(32, sizeof(float) * (size_t)(M * 2 * PNR));
        if (!probe) return -1;
        free(probe);
    }
    panel_job job = {x, M, K, count, {0}, {0}, {0}, {0}, {0}};
    int64_t work = 0;
    for (int i = 0; i < count; i++) {
        job.w[i] = w[i]; job.b[i] = b[i]; job.y[i] = y[i]; job.N[i] = N[i];
        job.first[i + 1] = job.first[i] + (N[i] + PNR - 1) / PNR;
        work += M * N[i] * K;
    }
    const int64_t total = job.first[count];
    /* ~64 chunks (even, so one- and two-row passes keep their panel pairs) balance the threads */
    int64_t grain = work < 65536 ? total : (total + 63) / 64;
    grain += grain & 1;
    if (total) parallel_for(panel_range, &job, total, grain > 0 ? grain : 1, threads);
    return 0;
}
