/* ======== blocked float32 GEMM for prefill: many rows, AVX2+FMA (whatever the caller's ISA) ========
 * y [M, N] = x [M, K] . w [N, K]^T (+ b), the way BLAS libraries do it: x is packed once into panels
 * of 6 rows (k-major), w into panels of 16 rows (transposed to k-major, KC k at a time, while they
 * stream in), and a 6x16 register tile (12 accumulators) does 12 fused multiply-adds per 8 loads.
 * Threads split w's panels, so each weight is read from memory once. Every y[m, n] is the same
 * chain of operations (k in blocks of KC, each block an FMA chain, blocks added in order, bias
 * first) whatever M and the other rows are: rows stay independent, though their numbers differ
 * from `rowwise_linear`'s (another summation order). Measured on 2 Zen 3 cores, 150 rows: about
 * 140 GFLOPS, where PyTorch's MKL path gave 75-120 on the same shapes. */
#include "common.h"
#include "kernels.h"

#define GMR 6     /* rows of x per register tile */
#define GNR 16    /* rows of w per register tile (2 vectors) */
#define GKC 256   /* k per packed block: a 16-row w panel is 16 KB, in L1 */
#define GMC 96    /* rows of x per sweep over a thread's packed w panels (96 KB of x, in L2) */
#define GPANELS 4 /* w panels a thread packs and keeps per k block (64 KB) */
_Static_assert(GKC == PKC && GNR == PNR, "panel matrices are read in place: the same panels and k blocks");

static inline void transpose8x8(__m256 *r)
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

#define GMAX 4      /* matrices per blocked_linear_group call */

/* One product of a group: y [M, N] = x . w^T (+ b); panels [first, first + ceil(N / 16)) of the job.
 * w is float32 [N, K] (VS_BLOCKED_F32), int4 codes [N, K / 2] with scales s [N, K / I4GROUP]
 * (VS_BLOCKED_INT4, the `Int4Matrix` layout, widened to float32 as its panels are packed), or float32
 * already in the panels this GEMM packs, [ceil(N / 16)][K][16] (VS_BLOCKED_PANELS, `PanelMatrix`: read
 * in place). */
typedef struct { const void *w; const float *s; const float *b; float *y; int64_t N, first; int kind; } blocked_part;
typedef struct { const float *x; float *xp; int64_t M, K; int count; blocked_part parts[GMAX]; } blocked_job;

/* x rows -> xp [M / 6][K][6], rows past M zero. Range over 6-row blocks. */
static void blocked_pack_x(const void *arg, int64_t begin, int64_t end)
{
    const blocked_job *job = arg;
    const int64_t M = job->M, K = job->K;
    for (int64_t mb = begin; mb < end; mb++) {
        float *dst = job->xp + mb * K * GMR;
        const int64_t rows = M - mb * GMR < GMR ? M - mb * GMR : GMR;
        const float *src[GMR];
        for (int i = 0; i < GMR; i++) src[i] = job->x + (mb * GMR + (i < rows ? i : 0)) * K;
        int64_t k = 0;
        for (; k + 8 < K; k += 8) {  /* 8 k of 6 rows: transpose 8x8 (2 rows zero), store 8 wide at stride 6 */
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = i < rows ? _mm256_loadu_ps(src[i] + k) : _mm256_setzero_ps();
            transpose8x8(r);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + (k + j) * GMR, r[j]);  /* the next store overwrites 2; */
        }                                                                              /* the last k stay scalar */
        for (; k < K; k++)
            for (int i = 0; i < GMR; i++) dst[k * GMR + i] = i < rows ? src[i][k] : 0.0f;
    }
}

/* rows [0, rows) of a float32 block (row j at src + j * stride, kc values) -> wp [kc][16], rows past
 * `rows` zero. */
static void blocked_pack_w(const float *src, int64_t stride, int64_t rows, int64_t kc, float *wp)
{
    if (rows == GNR && kc % 8 == 0) {
        for (int half = 0; half < 2; half++)
            for (int64_t k = 0; k < kc; k += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(src + (half * 8 + j) * stride + k);
                transpose8x8(r);
                for (int j = 0; j < 8; j++) _mm256_store_ps(wp + (k + j) * GNR + half * 8, r[j]);
            }
        return;
    }
    for (int64_t k = 0; k < kc; k++)
        for (int j = 0; j < GNR; j++) wp[k * GNR + j] = j < rows ? src[j * stride + k] : 0.0f;
}

/* int4 rows [n0, n0 + rows) x k [k0, k0 + kc) (whole groups) -> float32 rows out [rows][GKC]:
 * byte i of a group holds weight i (low nibble) and weight i + 32 (high), w = (code - 8) * scale. */
static void blocked_widen_int4(const uint8_t *w, const float *s, int64_t K, int64_t n0, int64_t rows, int64_t k0,
                               int64_t kc, float *out)
{
    const int64_t groups = K / I4GROUP;
    for (int64_t j = 0; j < rows; j++)
        for (int64_t g = k0 / I4GROUP; g < (k0 + kc) / I4GROUP; g++) {
            const uint8_t *codes = w + (n0 + j) * (K / 2) + g * (I4GROUP / 2);
            const float scale = s[(n0 + j) * groups + g];
            float *dst = out + j * GKC + g * I4GROUP - k0;
            for (int i = 0; i < I4GROUP / 2; i++) {
                dst[i] = (float)((int)(codes[i] & 15) - 8) * scale;
                dst[i + I4GROUP / 2] = (float)((int)(codes[i] >> 4) - 8) * scale;
            }
        }
}

/* y[6][16] (row stride ldy) = (accumulate ? y : bias or 0) + xp[kc][6] . wp[kc][16] */
static void blocked_tile(int64_t kc, const float *xp, const float *wp, float *y, int64_t ldy, int accumulate,
                         const float *bias)
{
    __m256 acc[GMR][2];
    for (int i = 0; i < GMR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_load_ps(wp + k * GNR), w1 = _mm256_load_ps(wp + k * GNR + 8);
        _Pragma("GCC unroll 6") for (int i = 0; i < GMR; i++) {
            const __m256 xv = _mm256_broadcast_ss(xp + k * GMR + i);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < GMR; i++) {
        __m256 base0 = _mm256_setzero_ps(), base1 = _mm256_setzero_ps();
        if (accumulate) { base0 = _mm256_loadu_ps(y + i * ldy); base1 = _mm256_loadu_ps(y + i * ldy + 8); }
        else if (bias) { base0 = _mm256_loadu_ps(bias); base1 = _mm256_loadu_ps(bias + 8); }
        _mm256_storeu_ps(y + i * ldy, _mm256_add_ps(base0, acc[i][0]));
        _mm256_storeu_ps(y + i * ldy + 8, _mm256_add_ps(base1, acc[i][1]));
    }
}

/* Panels [begin, end) of one part, all of its k blocks; edge tiles (M % 6 rows, N % 16 columns) go
 * through a scratch tile, so nothing outside y is touched. */
static void blocked_panels(const blocked_job *job, const blocked_part *part, int64_t begin, int64_t end)
{
    const int64_t M = job->M, N = part->N, K = job->K, mblocks = (M + GMR - 1) / GMR;
    float wp[GPANELS * GKC * GNR] __attribute__((aligned(64)));
    float widened[part->kind == VS_BLOCKED_INT4 ? GNR * GKC : 1];
    float edge[GMR * GNR] __attribute__((aligned(32)));
    float bias[GNR];
    for (int64_t p0 = begin; p0 < end; p0 += GPANELS) {
        const int64_t p1 = p0 + GPANELS < end ? p0 + GPANELS : end;
        for (int64_t k0 = 0; k0 < K; k0 += GKC) {
            const int64_t kc = K - k0 < GKC ? K - k0 : GKC;
            for (int64_t p = p0; p < p1 && part->kind != VS_BLOCKED_PANELS; p++) {
                const int64_t n0 = p * GNR, rows = N - n0 < GNR ? N - n0 : GNR;
                if (part->kind == VS_BLOCKED_INT4) {
                    blocked_widen_int4(part->w, part->s, K, n0, rows, k0, kc, widened);
                    blocked_pack_w(widened, GKC, rows, kc, wp + (p - p0) * GKC * GNR);
                } else {
                    blocked_pack_w((const float *)part->w + n0 * K + k0, K, rows, kc, wp + (p - p0) * GKC * GNR);
                }
            }
            for (int64_t mb0 = 0; mb0 < mblocks; mb0 += GMC / GMR) {
                const int64_t mb1 = mb0 + GMC / GMR < mblocks ? mb0 + GMC / GMR : mblocks;
                for (int64_t p = p0; p < p1; p++) {
                    const int64_t n0 = p * GNR, cols = N - n0 < GNR ? N - n0 : GNR;
                    const float *b = part->b ? part->b + n0 : 0;
                    const float *panel = part->kind == VS_BLOCKED_PANELS ? (const float *)part->w + (p * K + k0) * GNR
                                                         : wp + (p - p0) * GKC * GNR;
                    if (b && cols < GNR) {
                        for (int j = 0; j < GNR; j++) bias[j] = j < cols ? b[j] : 0.0f;
                        b = bias;
                    }
                    for (int64_t mb = mb0; mb < mb1; mb++) {
                        const int64_t m0 = mb * GMR, rows = M - m0 < GMR ? M - m0 : GMR;
                        const float *xp = job->xp + mb * K * GMR + k0 * GMR;
                        float *y = part->y + m0 * N + n0;
                        if (rows == GMR && cols == GNR) {
                            blocked_tile(kc, xp, panel, y, N, k0 > 0, b);
                            continue;
                        }
                        if (k0 > 0)
                            for (int i = 0; i < rows; i++) memcpy(edge + i * GNR, y + i * N, sizeof(float) * (size_t)cols);
                        blocked_tile(kc, xp, panel, edge, GNR, k0 > 0, b);
                        for (int i = 0; i < rows; i++) memcpy(y + i * N, edge + i * GNR, sizeof(float) * (size_t)cols);
                    }
                }
            }
        }
    }
}

/* Panels [begin, end) of the job, numbered across its parts in order. */
static void blocked_range(const void *arg, int64_t begin, int64_t end)
{
    const blocked_job *job = arg;
    for (int i = 0; i < job->count && begin < end; i++) {
        const blocked_part *part = &job->parts[i];
        const int64_t first = part->first, last = first + (part->N + GNR - 1) / GNR;
        if (begin >= last) continue;
        const int64_t stop = end < last ? end : last;
        blocked_panels(job, part, begin - first, stop - first);
        begin = stop;
    }
}

/* y[i] = x . w[i]^T (+ b[i]) for the `count` (at most GMAX) matrices of width K sharing x [M, K] (see
 * vs_blocked): x is packed once into xp (ceil(M / 6) * 6 * K floats of scratch), then threads split
 * all the parts' weight panels. */
void blocked_linear(const vs_blocked *a, int threads)
{
    blocked_job job = {a->x, a->xp, a->M, a->K, a->count < GMAX ? a->count : GMAX, {{0}}};
    int64_t panels = 0;
    for (int i = 0; i < job.count; i++) {
        job.parts[i] = (blocked_part){a->w[i], a->s[i], a->b[i], a->y[i], a->N[i], panels, a->kind[i]};
        panels += (a->N[i] + GNR - 1) / GNR;
    }
    parallel_for(blocked_pack_x, &job, (a->M + GMR - 1) / GMR, 4, threads);
    parallel_for(blocked_range, &job, panels, GPANELS, threads);
}
