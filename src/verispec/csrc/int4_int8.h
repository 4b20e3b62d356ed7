/* The int8-activation int4 products' shared part (int4_vnni.c, int4_avx2.c): each activation row is
 * rounded to int8 per group of I4GROUP and the weights' nibbles multiplied by those bytes in integer
 * arithmetic (see the two files). Included by both, so each compiles it with its own ISA. */
#ifndef VS_INT4_INT8_H
#define VS_INT4_INT8_H

#include "common.h"

/* qx [M, K] int8, qs [M, K / I4GROUP] float scales, qc [M, K / I4GROUP, lanes] int32 starting lanes */
typedef struct { const int8_t *qx; const float *qs; const int32_t *qc; const uint8_t *w; const float *s; const float *b;
                 float *y; int64_t M, N, K; } vnni_job;

/* The shared start of the int8-activation int4 products: x rounded to int8 per group by `quantize` into
 * one scratch block (qx [M, K], `lanes` int32 starting lanes and a float scale per row and group), then
 * `count` products of that x as one job over all their weight tiles (one wake of the pool). Fills jobs
 * and tiles for the caller's edge rows; returns the scratch for the caller to free, 0 if memory ran out. */
typedef void (*quantize_fn)(const float *, int8_t *, float *, int32_t *, int64_t, int64_t);
static inline int8_t *int4_group_run(quantize_fn quantize, int lanes, range_fn range, vnni_job *jobs, int64_t *tiles,
                                     const float *x, int count, const uint8_t *const *w, const float *const *s,
                                     const float *const *b, float *const *y, const int64_t *N, int64_t M, int64_t K,
                                     int threads)
{
    const int64_t groups = K / I4GROUP;
    const size_t bytes = (size_t)(M * K + M * groups * (lanes * 4 + 4));
    int8_t *qx = aligned_alloc(64, (bytes + 63) / 64 * 64);  /* a whole number of alignments, as C11 asks */
    if (!qx) return 0;
    int32_t *qc = (int32_t *)(qx + M * K);
    float *qs = (float *)(qc + M * groups * lanes);
    quantize(x, qx, qs, qc, M, K);
    const void *job_ptrs[MAX_GROUP] = {0};
    int64_t work = 0;
    for (int i = 0; i < count; i++) {
        jobs[i] = (vnni_job){qx, qs, qc, w[i], s[i], b[i], y[i], M, N[i], K};
        job_ptrs[i] = &jobs[i];
        tiles[i] = N[i] / NR;
        work += M * N[i] * K;
    }
    run_group(range, job_ptrs, tiles, count, work, threads);
    return qx;
}

#endif
