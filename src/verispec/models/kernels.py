"""CPU kernels for small passes (a few tokens per row): fast at small batch, exact row by row.

Decoding and verifying push a handful of activation rows (1 to ~16) through every weight matrix,
so the cost is reading the weights from memory, not arithmetic. PyTorch's CPU GEMMs (MKL, oneDNN)
are tuned for big batches: on a 2-core AVX-512 VM a 5-row product costs 2-3x a 1-row product
although both read the same bytes. Worse for speculative decoding, they take different code paths
for different row counts, so a row of an 8-row product need not equal the same row computed alone.

These kernels fix both in the decode regime:
- `rowwise_linear`: y = x W^T (+ b), the weight read once per tile of up to 6 rows, every output
  element accumulated by the same fused multiply-adds in the same order whatever the row count;
- `slot_attention`: attention of the new tokens over the visible slots of a slot cache (keys kept
  d-major so one vector op scores 16 slots); invisible slots are skipped, not masked, so holes,
  padding and batch mates cannot change a row's numbers;
- `rms_norm`, `rope_`, `silu_mul_`, `cache_write`: the glue between them, so a small pass costs a
  dozen calls per layer instead of ~40 PyTorch ops.
Every row's output is thus bitwise independent of how many rows share the pass: a width-k verify
pass sees exactly the numbers of k single-token steps. Activations and accumulation are float32;
`rowwise_linear` also takes bfloat16 weights (half the bytes), weight-only int8 (`Int8Matrix`, a
quarter) and grouped int4 (`Int4Matrix`, about a seventh), all for draft models. int4 matrices
multiply activations rounded to int8 per group of 64 (integer dot products: AVX-512 VNNI's vpdpbusd,
or AVX2's vpmaddubsw): unpacking 4-bit weights to float left that kernel compute-bound (a 4-bit Qwen
0.5B draft step took 32 ms on two AVX2 cores; 19.6 ms with int8 activations, ~20 GB/s). The rounding
reads only the row's own values, so rows stay independent there too (VERISPEC_INT4_FLOAT=1 keeps
the float path).

A model converted from a GGUF file (the zoo's) holds float32 weights that gguf's dequantizer made
from Q4_K / Q6_K blocks. `Q4KMatrix` / `Q6KMatrix` (`ExactBlocks`) keep those blocks (0.75 and 1.25
bytes per weight with their float32 scales) and rebuild each weight with the dequantizer's own
multiply and subtract, unfused, before the float32 arithmetic of the float32 matrix: the products
are bitwise the float32 matrix's, checked weight by weight when a matrix is built. For one or two
rows the weights are rebuilt in registers; for more, a tile's rows are widened one k block at a time
into an L1 scratch that the float32 tiles then read. Qwen2.5-Coder 1.5B reads 1.4 GB per step
instead of 7.1; the step becomes bound by the rebuilding arithmetic (~3 cycles per 8 weights).

Prefill is the other regime: hundreds of rows, compute-bound. `blocked_linear` is a classic blocked
GEMM for it (packed panels, 6x16 register tiles, AVX2+FMA), used where PyTorch's GEMM is slow: on
2 AVX2 Zen 3 cores ~130-145 GFLOPS where MKL's path gave 75-120. Its rows are independent too,
though its sums run in another order than `rowwise_linear`'s on row-major matrices.

`PanelMatrix` stores a float32 matrix in that GEMM's own panels (16 rows, k-major), once, at load.
Small passes then read the matrix as one stream, and a 7-16-row pass re-reads each 16 KB k block
from L1 rather than the row-major tiles' 2-4 rows from memory: on 2 AVX2 Zen 3 cores a Qwen 1.5B
pass of 8 rows cost 1.27-1.41x one row against 1.60x, 12 rows 1.37-1.56x against 2.0x, and one row
~5% less. Each output is the GEMM's chain of sums, so a small pass gives a row bitwise what a
prefill gives it.

The C source has AVX-512 and AVX2+FMA variants, picked by what the CPU supports. It is compiled
once with the system C compiler into the verispec cache and called through ctypes. It runs on
`torch.get_num_threads()` threads of its own small pool, in which the caller never waits for a
thread that has not started: on a machine shared with busy processes, OpenMP's barriers (with
libgomp's default busy-waiting) made a pass 8x slower with 2 threads than with 1; this pool
degrades to about 1-thread speed instead. Without a
compiler or a suitable CPU, `available()` is False and callers stay with PyTorch.
This module knows nothing about models: it does arithmetic on the buffers it is handed.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Keys are stored in blocks of this many slots (d-major inside a block); capacities are multiples of it.
SLOT_BLOCK = 16

# Rows one small pass may hold. Above this (prefill), a blocked GEMM is faster, and exactness
# across widths no longer matters: the engine never compares a prefill row with a decode row.
MAX_ROWS = 32

_PREAMBLE = r"""
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Grouped int4 quantization (`Int4Matrix.quantize`): for each group of 64 weights, of the scales
 * peak * shrink / 7 (shrinks[0..count)), the one with the least squared rounding error (the first of
 * equals), then the codes q + 8 packed two to a byte (low nibble: weight i, high: weight i + 32).
 * The same float32 operations as the PyTorch reference, but a group stays in registers instead of
 * every candidate streaming the whole matrix through memory (a 1.5B model: ~90 s -> a few seconds).
 * Each weight's code is x * (1 / scale) (the float32 reciprocal: a multiply is cheaper than a division)
 * rounded to nearest even and clamped to [-8, 7], in vectors (int4_quantize_rows512 / int4_quantize_rows256). */
typedef struct { const float *w; uint8_t *packed; float *scale; const float *shrinks; int64_t K; int count; } quantize_job;
#define I4MAXSHRINKS 16  /* most candidate scales per group */

/* Built with -ffp-contract=off: the compiler never fuses a*b+c by itself, so scalar code rounds
 * exactly as written and only the explicit fmadd intrinsics fuse. */

/* ======== a small thread pool that never waits for a thread that has not started ========
 * OpenMP's fork/join makes every parallel region wait at a barrier for all its threads. On a
 * machine shared with other busy processes (2 cores here), a descheduled OpenMP thread costs the
 * region a scheduler time slice, and a forward pass has ~250 regions: measured 8x slower than one
 * thread. Here the caller claims chunks of the range like any worker, and waits only for chunks a
 * worker has actually claimed; a worker that wakes late finds nothing left. Workers spin briefly
 * between jobs (a pass issues them back to back), then sleep. */
typedef void (*range_fn)(const void *job, int64_t begin, int64_t end);

#define TAG_SHIFT 40  /* pool_next = job tag << 40 | next index: a late worker cannot claim a newer job's chunks */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static int pool_workers = 0;
static _Atomic uint64_t pool_generation = 0;
static _Atomic uint64_t pool_next = 0;
static _Atomic int64_t pool_done = 0;
static range_fn pool_fn;
static const void *pool_job;
static int64_t pool_total, pool_grain;
static int pool_helpers;
static _Atomic int pool_busy = 0;  /* ctypes drops the GIL: a second caller thread runs its job alone */

static void run_ranges(uint64_t generation, range_fn fn, const void *job, int64_t total, int64_t grain)
{
    const uint64_t tag = generation & 0xFFFFFF;
    for (;;) {
        uint64_t current = atomic_load(&pool_next);
        if ((current >> TAG_SHIFT) != tag) return;
        const int64_t begin = (int64_t)(current & ((1ull << TAG_SHIFT) - 1));
        if (begin >= total) return;
        const int64_t end = begin + grain < total ? begin + grain : total;
        if (!atomic_compare_exchange_weak(&pool_next, &current, (tag << TAG_SHIFT) | (uint64_t)end)) continue;
        fn(job, begin, end);
        atomic_fetch_add(&pool_done, end - begin);
    }
}

static void *pool_worker(void *arg)
{
    const int index = (int)(intptr_t)arg;
    uint64_t seen = 0;
    for (;;) {
        for (int spin = 0; spin < 4000 && atomic_load(&pool_generation) == seen; spin++) _mm_pause();
        pthread_mutex_lock(&pool_lock);
        while (atomic_load(&pool_generation) == seen) pthread_cond_wait(&pool_wake, &pool_lock);
        seen = atomic_load(&pool_generation);
        const range_fn fn = pool_fn;
        const void *job = pool_job;
        const int64_t total = pool_total, grain = pool_grain;
        const int helping = index < pool_helpers;
        pthread_mutex_unlock(&pool_lock);
        if (helping) run_ranges(seen, fn, job, total, grain);
    }
    return 0;
}

/* fn(job, begin, end) over [0, total) in chunks of `grain`, on up to `threads` threads (caller included). */
static void parallel_for(range_fn fn, const void *job, int64_t total, int64_t grain, int threads)
{
    if (threads > 64) threads = 64;
    if (threads <= 1 || total <= grain || atomic_exchange(&pool_busy, 1)) { fn(job, 0, total); return; }
    pthread_mutex_lock(&pool_lock);
    while (pool_workers < threads - 1) {
        pthread_t thread;
        if (pthread_create(&thread, 0, pool_worker, (void *)(intptr_t)pool_workers)) break;
        pthread_detach(thread);
        pool_workers++;
    }
    const uint64_t generation = atomic_load(&pool_generation) + 1;
    pool_fn = fn; pool_job = job; pool_total = total; pool_grain = grain; pool_helpers = threads - 1;
    atomic_store(&pool_done, 0);
    atomic_store(&pool_next, (generation & 0xFFFFFF) << TAG_SHIFT);
    atomic_store(&pool_generation, generation);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
    run_ranges(generation, fn, job, total, grain);
    for (int spin = 0; atomic_load(&pool_done) < total; spin++) {
        if (spin < 20000) _mm_pause(); else sched_yield();  /* a claimed chunk's worker may be descheduled */
    }
    atomic_store(&pool_busy, 0);
}

/* s: one scale per weight row for int8 weights (w[n, k] = q[n, k] * s[n]), else unused */
typedef struct { const float *x; const void *w; const float *s; const float *b; float *y; int64_t M, N, K; } linear_job;
typedef struct {
    const float *q, *kc, *vc; const uint8_t *vis, *tree; float *out;
    int64_t B, T, H, KVH, D, cap, vis_stride, start; float scale; _Atomic int failed;
} attention_job;

#define NR 4  /* weight rows per linear tile */
#define SLOT_BLOCK 16  /* slots per key block: keys are [capacity / 16, D, 16] per (row, kv head) */
/* tiles take (x, w, saved accumulators, k0, k1, K); declared per vector type in the templates */
#define KBLOCK 512  /* k per pass of the row tiles: 4 weight rows + 6 activation rows = 20 KB, in L1 */
#define I4GROUP 64  /* int4 weights per scale, along k */
#define _unscaled(sum, scale) (sum)
#define _scaled(sum, scale) ((sum) * (scale))
"""

_BLOCKED = r"""
/* ======== blocked float32 GEMM for prefill: many rows, AVX2+FMA ========
 * y [M, N] = x [M, K] . w [N, K]^T (+ b), the way BLAS libraries do it: x is packed once into panels
 * of 6 rows (k-major), w into panels of 16 rows (transposed to k-major, KC k at a time, while they
 * stream in), and a 6x16 register tile (12 accumulators) does 12 fused multiply-adds per 8 loads.
 * Threads split w's panels, so each weight is read from memory once. Every y[m, n] is the same
 * chain of operations (k in blocks of KC, each block an FMA chain, blocks added in order, bias
 * first) whatever M and the other rows are: rows stay independent, though their numbers differ
 * from `rowwise_linear`'s (another summation order). Measured on 2 Zen 3 cores, 150 rows: about
 * 140 GFLOPS, where PyTorch's MKL path gave 75-120 on the same shapes. */
#define GMR 6     /* rows of x per register tile */
#define GNR 16    /* rows of w per register tile (2 vectors) */
#define GKC 256   /* k per packed block: a 16-row w panel is 16 KB, in L1 */
#define GMC 96    /* rows of x per sweep over a thread's packed w panels (96 KB of x, in L2) */
#define GPANELS 4 /* w panels a thread packs and keeps per k block (64 KB) */
_Static_assert(GKC == PKC && GNR == PNR, "panel matrices are read in place: the same panels and k blocks");

__attribute__((target("avx2,fma"))) static inline void transpose8x8(__m256 *r)
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
 * w is float32 [N, K] (kind 0), int4 codes [N, K / 2] with scales s [N, K / I4GROUP] (kind 1, the
 * `Int4Matrix` layout, widened to float32 as its panels are packed), or float32 already in the
 * panels this GEMM packs, [ceil(N / 16)][K][16] (kind 2, `PanelMatrix`: read in place). */
typedef struct { const void *w; const float *s; const float *b; float *y; int64_t N, first; int kind; } blocked_part;
typedef struct { const float *x; float *xp; int64_t M, K; int count; blocked_part parts[GMAX]; } blocked_job;

/* x rows -> xp [M / 6][K][6], rows past M zero. Range over 6-row blocks. */
__attribute__((target("avx2,fma"))) static void blocked_pack_x(const void *arg, int64_t begin, int64_t end)
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
__attribute__((target("avx2,fma"))) static void blocked_pack_w(const float *src, int64_t stride, int64_t rows,
                                                                int64_t kc, float *wp)
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
__attribute__((target("avx2,fma"))) static void blocked_widen_int4(const uint8_t *w, const float *s, int64_t K,
                                                                    int64_t n0, int64_t rows, int64_t k0, int64_t kc,
                                                                    float *out)
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
__attribute__((target("avx2,fma"))) static void blocked_tile(int64_t kc, const float *xp, const float *wp, float *y,
                                                              int64_t ldy, int accumulate, const float *bias)
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
__attribute__((target("avx2,fma"))) static void blocked_panels(const blocked_job *job, const blocked_part *part,
                                                                int64_t begin, int64_t end)
{
    const int64_t M = job->M, N = part->N, K = job->K, mblocks = (M + GMR - 1) / GMR;
    float wp[GPANELS * GKC * GNR] __attribute__((aligned(64)));
    float widened[part->kind == 1 ? GNR * GKC : 1];
    float edge[GMR * GNR] __attribute__((aligned(32)));
    float bias[GNR];
    for (int64_t p0 = begin; p0 < end; p0 += GPANELS) {
        const int64_t p1 = p0 + GPANELS < end ? p0 + GPANELS : end;
        for (int64_t k0 = 0; k0 < K; k0 += GKC) {
            const int64_t kc = K - k0 < GKC ? K - k0 : GKC;
            for (int64_t p = p0; p < p1 && part->kind != 2; p++) {
                const int64_t n0 = p * GNR, rows = N - n0 < GNR ? N - n0 : GNR;
                if (part->kind == 1) {
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
                    const float *panel = part->kind == 2 ? (const float *)part->w + (p * K + k0) * GNR
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

/* y[i] = x . w[i]^T (+ b[i]) for `count` (at most GMAX) matrices of width K sharing x [M, K] (of
 * kind[i], see blocked_part): x is packed once into xp (ceil(M / 6) * 6 * K floats of scratch), then
 * threads split all the parts' weight panels. */
void blocked_linear_group(const float *x, int count, const void *const *w, const float *const *s, const float *const *b,
                          float *const *y, const int64_t *N, const int *kind, int64_t M, int64_t K, float *xp, int threads)
{
    blocked_job job = {x, xp, M, K, count < GMAX ? count : GMAX, {{0}}};
    int64_t panels = 0;
    for (int i = 0; i < job.count; i++) {
        job.parts[i] = (blocked_part){w[i], s[i], b[i], y[i], N[i], panels, kind[i]};
        panels += (N[i] + GNR - 1) / GNR;
    }
    parallel_for(blocked_pack_x, &job, (M + GMR - 1) / GMR, 4, threads);
    parallel_for(blocked_range, &job, panels, GPANELS, threads);
}
"""

# Per-ISA helpers that the shared templates below call as $NAME.
_ISA_HELPERS = {
    "512": r"""
__attribute__((target("avx512f"))) static inline __mmask16 mask512(int64_t n) { return (__mmask16)((1u << n) - 1u); }
__attribute__((target("avx512f"))) static inline __m512 loadn512(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(mask512(n), p); }
__attribute__((target("avx512f"))) static inline void storen512(float *p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, mask512(n), v); }
__attribute__((target("avx512f"))) static inline __m512 keepn512(__m512 v, int64_t n) { return _mm512_maskz_mov_ps(mask512(n), v); }
__attribute__((target("avx512f"))) static inline __m512 round512(__m512 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
__attribute__((target("avx512f"))) static inline __m512 pow2mul512(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }
/* bfloat16 -> float32 is exact: the 16 bits become the top half of the float */
__attribute__((target("avx512f"))) static inline __m512 bf16load512(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
__attribute__((target("avx512f"))) static inline __m512 bf16loadn512(const uint16_t *p, int64_t n)
{
    uint16_t part[16] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return bf16load512(part);
}
/* int8 -> float32 is exact; the row's scale is applied once, to the finished sum */
__attribute__((target("avx512f"))) static inline __m512 i8load512(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
__attribute__((target("avx512f"))) static inline __m512 i8loadn512(const int8_t *p, int64_t n)
{
    int8_t part[16] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return i8load512(part);
}
/* exact k-quant weights rebuilt in registers, as widen_q4k / widen_q6k do (16 bytes of codes) */
__attribute__((target("avx512f"))) static inline __m512 q4kweights512(const uint8_t *p, int shift, __m512 scale, __m512 min)
{
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(bytes, shift), _mm512_set1_epi32(15));
    return _mm512_sub_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(q)), min);
}
__attribute__((target("avx512f"))) static inline __m512 q6kweights512(const int8_t *p, __m512 scale)
{
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
}
/* int4: a group's 16 possible weights (q - 8) * scale, looked up by nibble in one permute */
__attribute__((target("avx512f"))) static inline __m512 i4table512(float scale)
{
    return _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_ps(scale));
}
__attribute__((target("avx512f"))) static inline void i4unpack512(const uint8_t *p, __m512 table, __m512 *lo, __m512 *hi)
{
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
""",
    "256": r"""
__attribute__((target("avx2,fma"))) static inline __m256i mask256(int64_t n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
__attribute__((target("avx2,fma"))) static inline __m256 loadn256(const float *p, int64_t n) { return _mm256_maskload_ps(p, mask256(n)); }
__attribute__((target("avx2,fma"))) static inline void storen256(float *p, __m256 v, int64_t n) { _mm256_maskstore_ps(p, mask256(n), v); }
__attribute__((target("avx2,fma"))) static inline __m256 keepn256(__m256 v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(mask256(n))); }
__attribute__((target("avx2,fma"))) static inline __m256 round256(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
__attribute__((target("avx2,fma"))) static inline __m256 pow2mul256(__m256 p, __m256 n)
{   /* 2^n built in the exponent field; n is within [-126, 127] after exp's clamp */
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
__attribute__((target("avx2,fma"))) static inline __m256 bf16load256(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
__attribute__((target("avx2,fma"))) static inline __m256 bf16loadn256(const uint16_t *p, int64_t n)
{
    uint16_t part[8] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return bf16load256(part);
}
__attribute__((target("avx2,fma"))) static inline __m256 i8load256(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
__attribute__((target("avx2,fma"))) static inline __m256 i8loadn256(const int8_t *p, int64_t n)
{
    int8_t part[8] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return i8load256(part);
}
/* int4: (q - 8) converted exactly, times the group's scale (one rounding, as the table lookup) */
__attribute__((target("avx2,fma"))) static inline __m256 i4table256(float scale) { return _mm256_set1_ps(scale); }
__attribute__((target("avx2,fma"))) static inline void i4unpack256(const uint8_t *p, __m256 scale, __m256 *lo, __m256 *hi)
{
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), eight = _mm256_set1_epi32(8);
    *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), eight)), scale);
    *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight)), scale);
}
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
""",
}

_ISAS = {
    "512": {"$SFX": "512", "$ISA": '"avx512f"', "$VEC": "__m512", "$LANES": "16", "$MAXMR": "6", "$ROWS": "6", "$FULLMR": "6", "$QTILE": "8", "$DVECS": "4",
            "$ZERO": "_mm512_setzero_ps", "$SET1": "_mm512_set1_ps", "$LOADN": "loadn512", "$STOREN": "storen512",
            "$KEEPN": "keepn512", "$LOAD": "_mm512_loadu_ps", "$STORE": "_mm512_storeu_ps", "$ADD": "_mm512_add_ps",
            "$SUB": "_mm512_sub_ps", "$MUL": "_mm512_mul_ps", "$DIV": "_mm512_div_ps", "$FMA": "_mm512_fmadd_ps",
            "$MAX": "_mm512_max_ps", "$MIN": "_mm512_min_ps", "$HSUM": "_mm512_reduce_add_ps", "$ROUND": "round512",
            "$POW2MUL": "pow2mul512"},
    "256": {"$SFX": "256", "$ISA": '"avx2,fma"', "$VEC": "__m256", "$LANES": "8", "$MAXMR": "3", "$ROWS": "6", "$FULLMR": "2", "$QTILE": "4", "$DVECS": "2",
            "$ZERO": "_mm256_setzero_ps", "$SET1": "_mm256_set1_ps", "$LOADN": "loadn256", "$STOREN": "storen256",
            "$KEEPN": "keepn256", "$LOAD": "_mm256_loadu_ps", "$STORE": "_mm256_storeu_ps", "$ADD": "_mm256_add_ps",
            "$SUB": "_mm256_sub_ps", "$MUL": "_mm256_mul_ps", "$DIV": "_mm256_div_ps", "$FMA": "_mm256_fmadd_ps",
            "$MAX": "_mm256_max_ps", "$MIN": "_mm256_min_ps", "$HSUM": "hsum256", "$ROUND": "round256",
            "$POW2MUL": "pow2mul256"},
}

# The linear layer, instantiated per ISA and per weight storage type ($W: f32, bf16 or i8).
_LINEAR_TEMPLATE = r"""
/* ======== linear: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]); x [M, K], w [N, K], y [M, N] ========
 * Exactness: every y[m, n] owns one accumulator vector, fed x[m, k:k+L] * w[n, k:k+L] by one fused
 * multiply-add per L lanes in increasing k (a zero-filled tail last), then reduced by a fixed
 * shuffle sequence. The tile shape (how many rows share a pass over the weights) only decides which
 * accumulators are live together, never the arithmetic one of them sees. */
#define TILE_$SFX$W(MR, JN)                                                                         \
__attribute__((target($ISA))) static void tile$SFX$W##_##MR##x##JN(                                 \
    const float *x, const $WT *w, $VEC *saved, int64_t k0, int64_t k1, int64_t K, const char *next) \
{                                                                                                 \
    /* continue the accumulators saved [MR][NR] (columns 0 .. JN-1 of them) over k in [k0, k1) (plus \
     * the masked tail at the end); `next`, if set, is the next tile's weights: fetched into cache   \
     * while this one computes */                                                                 \
    $VEC acc[MR][JN];                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < JN; j++) acc[i][j] = k0 ? saved[i * NR + j] : $ZERO(); \
    for (int64_t k = k0; k < k1; k += $LANES) {                                                   \
        $VEC wv[JN];                                                                              \
        _Pragma("GCC unroll 4") for (int j = 0; j < JN; j++) {                                   \
            wv[j] = $WLOAD(w + j * K + k);                                                        \
            if (next) _mm_prefetch(next + (j * K + k) * (int64_t)sizeof($WT), _MM_HINT_T0);       \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                   \
            $VEC xv = $LOAD(x + i * K + k);                                                       \
            _Pragma("GCC unroll 4") for (int j = 0; j < JN; j++) acc[i][j] = $FMA(xv, wv[j], acc[i][j]); \
        }                                                                                         \
    }                                                                                             \
    if (k1 == K - K % $LANES && K > k1) {                                                         \
        $VEC wv[JN];                                                                              \
        for (int j = 0; j < JN; j++) wv[j] = $WLOADN(w + j * K + k1, K - k1);                      \
        for (int i = 0; i < MR; i++) {                                                            \
            $VEC xv = $LOADN(x + i * K + k1, K - k1);                                             \
            for (int j = 0; j < JN; j++) acc[i][j] = $FMA(xv, wv[j], acc[i][j]);                  \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < JN; j++) saved[i * NR + j] = acc[i][j];      \
}
/* Tiles of MR activation rows x all NR weight rows, and (for more rows than fit the vector registers
 * that way: MR * NR accumulators + NR weight vectors) MR rows x half the weight rows, called twice. */
typedef void (*tile$SFX$W_fn)(const float *, const $WT *, $VEC *, int64_t, int64_t, int64_t, const char *);
TILE_$SFX$W(1, 4) TILE_$SFX$W(2, 4)
TILE_$SFX$W(3, 2) TILE_$SFX$W(4, 2) TILE_$SFX$W(5, 2) TILE_$SFX$W(6, 2)
#if $FULLMR == 6  /* AVX-512: 32 registers hold 6 x 4 accumulators */
TILE_$SFX$W(3, 4) TILE_$SFX$W(4, 4) TILE_$SFX$W(5, 4) TILE_$SFX$W(6, 4)
static const tile$SFX$W_fn tiles$SFX$W[7] = {0, tile$SFX$W_1x4, tile$SFX$W_2x4, tile$SFX$W_3x4, tile$SFX$W_4x4, tile$SFX$W_5x4, tile$SFX$W_6x4};
#else  /* AVX2: 16 registers hold 2 x 4 */
static const tile$SFX$W_fn tiles$SFX$W[3] = {0, tile$SFX$W_1x4, tile$SFX$W_2x4};
#endif
static const tile$SFX$W_fn halves$SFX$W[7] = {0, 0, 0, tile$SFX$W_3x2, tile$SFX$W_4x2, tile$SFX$W_5x2, tile$SFX$W_6x2};

/* The last N % 4 weight rows: one weight row at a time, the same per-element arithmetic. */
__attribute__((target($ISA))) static void edge$SFX$W(const float *x, const $WT *w, const float *s, const float *b,
                                                  float *y, int64_t M, int64_t N, int64_t K)
{
    const int64_t kfull = K - K % $LANES;
    for (int64_t i = 0; i < M; i++) {
        $VEC acc = $ZERO();
        for (int64_t k = 0; k < kfull; k += $LANES) acc = $FMA($LOAD(x + i * K + k), $WLOAD(w + k), acc);
        if (K > kfull) acc = $FMA($LOADN(x + i * K + kfull, K - kfull), $WLOADN(w + kfull, K - kfull), acc);
        y[i * N] = $WSCALE($HSUM(acc), s[0]) + (b ? b[0] : 0.0f);
    }
}

/* Weight-row tiles [begin, end) of a linear_job: each weight byte is read by one thread, once per
 * row tile. k runs in blocks of KBLOCK so a tile's weight and activation rows stay in L1 while all
 * row tiles pass over them; the accumulators wait in `saved` between blocks, so every output still
 * sees one unbroken chain of multiply-adds in k order. */
__attribute__((target($ISA))) static void linear_range$SFX$W(const void *arg, int64_t begin, int64_t end)
{
    const linear_job *job = arg;
    const int64_t M = job->M, N = job->N, K = job->K, kfull = K - K % $LANES;
    $VEC local[64 * NR];
    $VEC *saved = M <= 64 ? local : aligned_alloc(64, sizeof($VEC) * (size_t)(M * NR));
    for (int64_t t = begin; t < end; t++) {
        const $WT *w = (const $WT *)job->w + t * NR * K;
        for (int64_t k0 = 0;; k0 += KBLOCK) {
            const int64_t k1 = k0 + KBLOCK < kfull ? k0 + KBLOCK : kfull;
            for (int64_t m0 = 0; m0 < M;) {
                /* Rows split evenly over the fewest passes: 8 rows -> 4 + 4 rather than 6 + 2. */
                const int64_t passes = (M - m0 + $ROWS - 1) / $ROWS;
                const int mr = (int)((M - m0 + passes - 1) / passes);
                /* the first row tile also prefetches the next weight tile: the hardware prefetcher
                 * needs a while to pick up 4 new rows, and the tiles' rows are short (6-35 KB) */
                const char *next = m0 == 0 && t + 1 < end ? (const char *)(w + NR * K) : 0;
                if (mr <= $FULLMR) {
                    tiles$SFX$W[mr](job->x + m0 * K, w, saved + m0 * NR, k0, k1, K, next);
                } else {
                    halves$SFX$W[mr](job->x + m0 * K, w, saved + m0 * NR, k0, k1, K, next);
                    halves$SFX$W[mr](job->x + m0 * K, w + 2 * K, saved + m0 * NR + 2, k0, k1, K,
                                     next ? next + 2 * K * (int64_t)sizeof($WT) : 0);
                }
                m0 += mr;
            }
            if (k1 >= kfull) break;
        }
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < NR; j++)
                job->y[m * N + t * NR + j] = $WSCALE($HSUM(saved[m * NR + j]), job->s[t * NR + j]) + (job->b ? job->b[t * NR + j] : 0.0f);
    }
    if (saved != local) free(saved);
}

"""

# 4-bit weights in groups with one scale each: their own tile (a group's table, two weights per byte).
_INT4_TEMPLATE = r"""
/* ======== int4 linear: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) with 4-bit weights ========
 * w [N, K / 2] bytes in groups of I4GROUP weights along k (32 bytes each): byte j of a group holds
 * weight j in its low nibble and weight j + 32 in its high one, as q + 8 (q in [-8, 7]); the
 * weight is q * s[n, k / I4GROUP]. Exactness as for the other formats: every y[m, n] owns one
 * accumulator fed, per group and per chunk of L bytes, x * (low weights) then x * (high weights),
 * in k order of the chunks; tiles only decide which accumulators are live together. */
typedef void (*tile$SFXi4_fn)(const float *, const uint8_t *, const float *, $VEC *, int64_t, int64_t, int64_t, const char *);
#define TILE_$SFX_I4(MR)                                                                           \
__attribute__((target($ISA))) static void tile$SFXi4_##MR(                                          \
    const float *x, const uint8_t *w, const float *s, $VEC *saved, int64_t g0, int64_t g1, int64_t K, const char *next) \
{                                                                                                 \
    const int64_t row_bytes = K / 2, row_groups = K / I4GROUP;                                    \
    $VEC acc[MR][NR];                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = g0 ? saved[i * NR + j] : $ZERO(); \
    for (int64_t g = g0; g < g1; g++) {                                                           \
        $VEC table[NR];                                                                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                   \
            table[j] = i4table$SFX(s[j * row_groups + g]);                                        \
            if (next) _mm_prefetch(next + j * row_bytes + g * (I4GROUP / 2), _MM_HINT_T0);        \
        }                                                                                         \
        _Pragma("GCC unroll 4") for (int c = 0; c < I4GROUP / 2; c += $LANES) {                  \
            $VEC lo[NR], hi[NR];                                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                 \
                i4unpack$SFX(w + j * row_bytes + g * (I4GROUP / 2) + c, table[j], &lo[j], &hi[j]); \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                               \
                const float *xg = x + i * K + g * I4GROUP + c;                                    \
                const $VEC xl = $LOAD(xg), xh = $LOAD(xg + I4GROUP / 2);                          \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                           \
                    acc[i][j] = $FMA(xl, lo[j], acc[i][j]);                                       \
                    acc[i][j] = $FMA(xh, hi[j], acc[i][j]);                                       \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}
TILE_$SFX_I4(1) TILE_$SFX_I4(2) TILE_$SFX_I4(3)
#if $MAXMR > 3
TILE_$SFX_I4(4) TILE_$SFX_I4(5) TILE_$SFX_I4(6)
static const tile$SFXi4_fn tiles$SFXi4[7] = {0, tile$SFXi4_1, tile$SFXi4_2, tile$SFXi4_3, tile$SFXi4_4, tile$SFXi4_5, tile$SFXi4_6};
#else
static const tile$SFXi4_fn tiles$SFXi4[4] = {0, tile$SFXi4_1, tile$SFXi4_2, tile$SFXi4_3};
#endif

/* Weight-row tiles [begin, end) of an int4 linear_job (the last N % 4 rows run as tiles of their own
 * rows by `edge`), groups in blocks so the activation rows stay in cache, as for the other formats. */
__attribute__((target($ISA))) static void linear_range$SFXi4(const void *arg, int64_t begin, int64_t end)
{
    const linear_job *job = arg;
    const int64_t M = job->M, N = job->N, K = job->K, groups = K / I4GROUP, gblock = KBLOCK / I4GROUP;
    $VEC local[64 * NR];
    $VEC *saved = M <= 64 ? local : aligned_alloc(64, sizeof($VEC) * (size_t)(M * NR));
    for (int64_t t = begin; t < end; t++) {
        const uint8_t *w = (const uint8_t *)job->w + t * NR * (K / 2);
        const float *s = job->s + t * NR * groups;
        for (int64_t g0 = 0; g0 < groups; g0 += gblock) {
            const int64_t g1 = g0 + gblock < groups ? g0 + gblock : groups;
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t passes = (M - m0 + $MAXMR - 1) / $MAXMR;
                const int mr = (int)((M - m0 + passes - 1) / passes);
                const char *next = m0 == 0 && t + 1 < end ? (const char *)(w + NR * (K / 2)) : 0;
                tiles$SFXi4[mr](job->x + m0 * K, w, s, saved + m0 * NR, g0, g1, K, next);
                m0 += mr;
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < NR; j++)
                job->y[m * N + t * NR + j] = $HSUM(saved[m * NR + j]) + (job->b ? job->b[t * NR + j] : 0.0f);
    }
    if (saved != local) free(saved);
}

/* The last N % 4 weight rows, one at a time: the same per-element arithmetic as a tile. */
__attribute__((target($ISA))) static void edge$SFXi4(const float *x, const uint8_t *w, const float *s, const float *b,
                                                  float *y, int64_t M, int64_t N, int64_t K)
{
    for (int64_t i = 0; i < M; i++) {
        $VEC acc = $ZERO();
        for (int64_t g = 0; g < K / I4GROUP; g++) {
            const $VEC table = i4table$SFX(s[g]);
            for (int c = 0; c < I4GROUP / 2; c += $LANES) {
                $VEC lo, hi;
                i4unpack$SFX(w + g * (I4GROUP / 2) + c, table, &lo, &hi);
                const float *xg = x + i * K + g * I4GROUP + c;
                acc = $FMA($LOAD(xg), lo, acc);
                acc = $FMA($LOAD(xg + I4GROUP / 2), hi, acc);
            }
        }
        y[i * N] = $HSUM(acc) + (b ? b[0] : 0.0f);
    }
}

/* Int4 quantization, $LANES lanes at a time. Per lane the operations of the PyTorch reference: the code
 * x * (1 / s) rounded to nearest even and clamped; the error q * s - x; r * r added to the lane's sum for
 * i = 0, 16, 32, 48; then the 16 lane sums added in order, so either ISA picks the same scale. */
__attribute__((target($ISA))) static void int4_quantize_rows$SFX(const void *arg, int64_t begin, int64_t end)
{
    const quantize_job *job = arg;
    const int64_t groups = job->K / 64;
    const $VEC low = $SET1(-8.0f), high = $SET1(7.0f);
    for (int64_t g = begin * groups; g < end * groups; g++) {
        const float *x = job->w + g * 64;
        $VEC most = $ZERO();  /* the largest |x| per lane: max(x, -x) */
        for (int i = 0; i < 64; i += $LANES) {
            const $VEC xv = $LOAD(x + i);
            most = $MAX(most, $MAX(xv, $SUB($ZERO(), xv)));
        }
        float lanes[$LANES], peak = 0.0f;
        $STORE(lanes, most);
        for (int j = 0; j < $LANES; j++) peak = lanes[j] > peak ? lanes[j] : peak;
        if (peak < 1e-12f) peak = 1e-12f;
        float candidates[I4MAXSHRINKS], sums[I4MAXSHRINKS][16], errors[I4MAXSHRINKS];
        for (int c = 0; c < job->count; c++) {
            candidates[c] = peak * job->shrinks[c] / 7.0f;
            const $VEC scale = $SET1(candidates[c]), inverse = $SET1(1.0f / candidates[c]);
            for (int v = 0; v < 16 / $LANES; v++) {
                $VEC sum = $ZERO();
                for (int i = 0; i < 64; i += 16) {
                    const $VEC xv = $LOAD(x + i + v * $LANES);
                    const $VEC q = $MIN($MAX($ROUND($MUL(xv, inverse)), low), high);
                    const $VEC r = $SUB($MUL(q, scale), xv);
                    sum = $ADD(sum, $MUL(r, r));
                }
                $STORE(sums[c] + v * $LANES, sum);
            }
            errors[c] = 0.0f;
        }
        /* each candidate's lane sums added in order; the candidates side by side, as independent chains */
        for (int j = 0; j < 16; j++)
            for (int c = 0; c < job->count; c++) errors[c] += sums[c][j];
        float best_scale = candidates[0], best_error = errors[0];
        for (int c = 1; c < job->count; c++)
            if (errors[c] < best_error) { best_scale = candidates[c]; best_error = errors[c]; }
        const $VEC inverse = $SET1(1.0f / best_scale);
        float codes[64];
        for (int i = 0; i < 64; i += $LANES)
            $STORE(codes + i, $MIN($MAX($ROUND($MUL($LOAD(x + i), inverse)), low), high));
        uint8_t *out = job->packed + g * 32;
        for (int i = 0; i < 32; i++) out[i] = (uint8_t)(((int)codes[i] + 8) | (((int)codes[i + 32] + 8) << 4));
        job->scale[g] = best_scale;
    }
}
"""

_EXACT_WIDEN = r"""
/* ======== GGUF k-quant blocks, widened to the very float32 weights they stand for ========
 * A model converted from a GGUF file holds float32 weights that gguf's reference dequantizer
 * computed from the file's blocks. Kept as those blocks, a weight is rebuilt here with the same
 * operations, rounded the same way (the file is built with -ffp-contract=off, so nothing fuses):
 * q4k: codes [N, K / 2] in 64-weight groups, byte j holding weight j (low nibble) and weight j + 32
 *      (high), the Q4_K super-block order; sm [N, K / 32, 2] each 32-weight sub-block's (scale, min),
 *      w = (scale * q) - min with q in [0, 15].
 * q6k: codes [N, K] int8, q in [-32, 31]; s [N, K / 16] a scale per 16 weights, w = scale * q.
 * Rows [0, rows) starting at w, k in [k0, k1) (whole groups), to out [rows][K] (row stride K). */
/* One Q4_K weight vector: 8 codes (the low nibbles, shift 0, or the high ones, shift 4), rebuilt. */
__attribute__((target("avx2,fma"))) static inline __m256 q4kweights256(const uint8_t *p, int shift, __m256 scale, __m256 min)
{
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(bytes, shift), _mm256_set1_epi32(15));
    return _mm256_sub_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(q)), min);
}
/* One Q6_K weight vector: 8 int8 codes, rebuilt. */
__attribute__((target("avx2,fma"))) static inline __m256 q6kweights256(const int8_t *p, __m256 scale)
{
    return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))));
}

/* `ahead` rows of codes and scales past the last one are fetched into cache meanwhile (the next
 * tile's: the widened rows are short pieces at a stride, which the hardware prefetcher follows late). */
__attribute__((target("avx2,fma"))) static void widen_q4k(const void *w, const float *sm, int64_t K, int rows,
                                                          int64_t k0, int64_t k1, float *out, int ahead)
{
    for (int j = 0; j < rows; j++) {
        const uint8_t *codes = (const uint8_t *)w + j * (K / 2);
        const float *pairs = sm + j * (K / 16);
        float *o = out + j * K;
        if (j < ahead) {
            for (int64_t b = k0 / 2; b < k1 / 2; b += 64) _mm_prefetch((const char *)(codes + rows * (K / 2) + b), _MM_HINT_T0);
            for (int64_t f = k0 / 16; f < k1 / 16; f += 16) _mm_prefetch((const char *)(pairs + rows * (K / 16) + f), _MM_HINT_T0);
        }
        for (int64_t g = k0 / 64; g < k1 / 64; g++) {
            const __m256 sa = _mm256_set1_ps(pairs[4 * g]), ma = _mm256_set1_ps(pairs[4 * g + 1]);
            const __m256 sb = _mm256_set1_ps(pairs[4 * g + 2]), mb = _mm256_set1_ps(pairs[4 * g + 3]);
            for (int c = 0; c < 32; c += 8) {
                _mm256_storeu_ps(o + g * 64 + c, q4kweights256(codes + g * 32 + c, 0, sa, ma));
                _mm256_storeu_ps(o + g * 64 + 32 + c, q4kweights256(codes + g * 32 + c, 4, sb, mb));
            }
        }
    }
}

__attribute__((target("avx2,fma"))) static void widen_q6k(const void *w, const float *s, int64_t K, int rows,
                                                          int64_t k0, int64_t k1, float *out, int ahead)
{
    for (int j = 0; j < rows; j++) {
        const int8_t *codes = (const int8_t *)w + j * K;
        const float *scales = s + j * (K / 16);
        float *o = out + j * K;
        if (j < ahead) {
            for (int64_t b = k0; b < k1; b += 64) _mm_prefetch((const char *)(codes + rows * K + b), _MM_HINT_T0);
            for (int64_t f = k0 / 16; f < k1 / 16; f += 16) _mm_prefetch((const char *)(scales + rows * (K / 16) + f), _MM_HINT_T0);
        }
        for (int64_t g = k0 / 16; g < k1 / 16; g++) {
            const __m256 scale = _mm256_set1_ps(scales[g]);
            for (int c = 0; c < 16; c += 8) _mm256_storeu_ps(o + g * 16 + c, q6kweights256(codes + g * 16 + c, scale));
        }
    }
}

typedef void (*widen_fn)(const void *w, const float *s, int64_t K, int rows, int64_t k0, int64_t k1, float *out, int ahead);
"""

# Exact k-quant matrices: each tile's weight rows widened one k block at a time into a float32 scratch
# laid out like a float32 matrix, then the float32 tiles: bit for bit the float32 arithmetic.
_EXACT_TEMPLATE = r"""
/* ======== exact k-quant weights: widen a block, then the float32 tiles on it ========
 * The same tiles, blocks, row passes and final reduction as linear_range$SFXf32, on weights rebuilt
 * exactly: every output is bitwise what the float32 matrix gives, from a fifth to a third of its
 * bytes. Both formats keep K / 16 floats of scales per row. */
/* For one or two activation rows (a decode step) the weights are rebuilt in registers instead, fed
 * straight to the same fused multiply-adds in the same k order: the float32 tile's arithmetic again,
 * with no scratch round trip. */
#define FUSED_$SFX(MR)                                                                              \
__attribute__((target($ISA))) static void fusedq4k$SFX_##MR(const float *x, const uint8_t *w, const float *sm, \
                                                         $VEC *saved, int64_t K, int ahead)        \
{                                                                                                 \
    $VEC acc[MR][NR];                                                                             \
    _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = $ZERO();               \
    for (int64_t g = 0; g < K / 64; g++) {                                                        \
        if (ahead && g % 2 == 0) _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {          \
            _mm_prefetch((const char *)(w + (NR + j) * (K / 2) + g * 32), _MM_HINT_T0);          \
            if (g % 4 == 0) _mm_prefetch((const char *)(sm + (NR + j) * (K / 16) + 4 * g), _MM_HINT_T0); \
        }                                                                                         \
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {                           \
            $VEC scale[NR], low[NR];                                                              \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                               \
                scale[j] = $SET1(sm[j * (K / 16) + 4 * g + 2 * half]);                            \
                low[j] = $SET1(sm[j * (K / 16) + 4 * g + 2 * half + 1]);                          \
            }                                                                                     \
            _Pragma("GCC unroll 4") for (int c = 0; c < 32; c += $LANES) {                       \
                $VEC wv[NR];                                                                      \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                             \
                    wv[j] = q4kweights$SFX(w + j * (K / 2) + g * 32 + c, 4 * half, scale[j], low[j]); \
                _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) {                           \
                    const $VEC xv = $LOAD(x + i * K + g * 64 + half * 32 + c);                    \
                    _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = $FMA(xv, wv[j], acc[i][j]); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}                                                                                                 \
__attribute__((target($ISA))) static void fusedq6k$SFX_##MR(const float *x, const uint8_t *w, const float *s, \
                                                         $VEC *saved, int64_t K, int ahead)        \
{                                                                                                 \
    $VEC acc[MR][NR];                                                                             \
    _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = $ZERO();               \
    for (int64_t g = 0; g < K / 16; g++) {                                                        \
        if (ahead && g % 4 == 0) _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {          \
            _mm_prefetch((const char *)(w + (NR + j) * K + g * 16), _MM_HINT_T0);                \
            if (g % 16 == 0) _mm_prefetch((const char *)(s + (NR + j) * (K / 16) + g), _MM_HINT_T0); \
        }                                                                                         \
        $VEC scale[NR];                                                                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) scale[j] = $SET1(s[j * (K / 16) + g]); \
        _Pragma("GCC unroll 2") for (int c = 0; c < 16; c += $LANES) {                           \
            $VEC wv[NR];                                                                          \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                 \
                wv[j] = q6kweights$SFX((const int8_t *)w + j * K + g * 16 + c, scale[j]);         \
            _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) {                               \
                const $VEC xv = $LOAD(x + i * K + g * 16 + c);                                    \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = $FMA(xv, wv[j], acc[i][j]); \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}
FUSED_$SFX(1) FUSED_$SFX(2)

/* MR activation rows x the NR widened weight rows over k in [k0, k1), continuing `saved`: the float32
 * tile's per-output arithmetic (one accumulator vector fed in k order), with the MR rows of x held in
 * registers and one weight vector loaded at a time, so MR x NR accumulators fit (3 x 4 on AVX2). */
#define WIDE_$SFX(MR)                                                                               \
__attribute__((target($ISA))) static void widetile$SFX_##MR(const float *x, const float *w, $VEC *saved, \
                                                          int64_t k0, int64_t k1, int64_t K)      \
{                                                                                                 \
    $VEC acc[MR][NR];                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = k0 ? saved[i * NR + j] : $ZERO(); \
    for (int64_t k = k0; k < k1; k += $LANES) {                                                   \
        $VEC xv[MR];                                                                              \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) xv[i] = $LOAD(x + i * K + k);      \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                   \
            const $VEC wv = $LOAD(w + j * K + k);                                                 \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) acc[i][j] = $FMA(xv[i], wv, acc[i][j]); \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) saved[i * NR + j] = acc[i][j];      \
}
WIDE_$SFX(1) WIDE_$SFX(2) WIDE_$SFX(3)
#if $MAXMR > 3
WIDE_$SFX(4) WIDE_$SFX(5) WIDE_$SFX(6)
#endif
typedef void (*widetile$SFX_fn)(const float *, const float *, $VEC *, int64_t, int64_t, int64_t);
#if $MAXMR > 3
static const widetile$SFX_fn widetiles$SFX[7] = {0, widetile$SFX_1, widetile$SFX_2, widetile$SFX_3, widetile$SFX_4, widetile$SFX_5, widetile$SFX_6};
#else
static const widetile$SFX_fn widetiles$SFX[4] = {0, widetile$SFX_1, widetile$SFX_2, widetile$SFX_3};
#endif
typedef void (*fused$SFX_fn)(const float *, const uint8_t *, const float *, $VEC *, int64_t, int);
#define FUSED_ROWS 2  /* activation rows up to which the weights are rebuilt in registers */

__attribute__((target($ISA))) static void linear_range_widened$SFX(const linear_job *job, int64_t begin, int64_t end,
                                                                 widen_fn widen, int64_t row_bytes,
                                                                 const fused$SFX_fn *fused)
{
    const int64_t M = job->M, N = job->N, K = job->K;
    $VEC local[64 * NR];
    $VEC *saved = M <= 64 ? local : aligned_alloc(64, sizeof($VEC) * (size_t)(M * NR));
    float *wide = M <= FUSED_ROWS ? 0 : aligned_alloc(64, sizeof(float) * (size_t)(NR * K));  /* K: a multiple of 256 */
    for (int64_t t = begin; t < end; t++) {
        const char *w = (const char *)job->w + t * NR * row_bytes;
        const float *s = job->s + t * NR * (K / 16);
        if (M <= FUSED_ROWS) fused[M](job->x, (const uint8_t *)w, s, saved, K, t + 1 < end);
        else for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
            const int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
            widen(w, s, K, NR, k0, k1, wide, t + 1 < end ? NR : 0);
            /* rows in passes of at most $MAXMR, split evenly: the widened weights are in L1 */
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t passes = (M - m0 + $MAXMR - 1) / $MAXMR;
                const int mr = (int)((M - m0 + passes - 1) / passes);
                widetiles$SFX[mr](job->x + m0 * K, wide, saved + m0 * NR, k0, k1, K);
                m0 += mr;
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < NR; j++)
                job->y[m * N + t * NR + j] = $HSUM(saved[m * NR + j]) + (job->b ? job->b[t * NR + j] : 0.0f);
    }
    free(wide);
    if (saved != local) free(saved);
}
__attribute__((target($ISA))) static void linear_range$SFXq4k(const void *arg, int64_t begin, int64_t end)
{
    static const fused$SFX_fn fused[3] = {0, fusedq4k$SFX_1, fusedq4k$SFX_2};
    linear_range_widened$SFX(arg, begin, end, widen_q4k, ((const linear_job *)arg)->K / 2, fused);
}
__attribute__((target($ISA))) static void linear_range$SFXq6k(const void *arg, int64_t begin, int64_t end)
{
    static const fused$SFX_fn fused[3] = {0, fusedq6k$SFX_1, fusedq6k$SFX_2};
    linear_range_widened$SFX(arg, begin, end, widen_q6k, ((const linear_job *)arg)->K, fused);
}
"""

# Written once, instantiated per ISA by replacing the $NAMEs (longest first: $LOADN before $LOAD).
_TEMPLATE = r"""
/* ======== exp, for softmax and SiLU ========
 * e^x = 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two parts for precision)
 * and e^r from a degree-6 polynomial on |r| <= ln2/2 (relative error ~1e-7). x is clamped to
 * [-87.3, 88.3]: e^-87.3 ~ 1e-38 stands in for 0. Every lane runs the same operations, so an
 * element's result never depends on its neighbours or its lane. */
__attribute__((target($ISA))) static inline $VEC exp$SFX($VEC x)
{
    x = $MIN($MAX(x, $SET1(-87.3f)), $SET1(88.3f));
    const $VEC n = $ROUND($MUL(x, $SET1(1.44269504088896341f)));
    $VEC r = $FMA(n, $SET1(-0.693359375f), x);
    r = $FMA(n, $SET1(2.12194440e-4f), r);
    $VEC p = $SET1(1.9875691500e-4f);
    p = $FMA(p, r, $SET1(1.3981999507e-3f));
    p = $FMA(p, r, $SET1(8.3334519073e-3f));
    p = $FMA(p, r, $SET1(4.1665795894e-2f));
    p = $FMA(p, r, $SET1(1.6666665459e-1f));
    p = $FMA(p, r, $SET1(5.0000001201e-1f));
    p = $FMA(p, $MUL(r, r), $ADD(r, $SET1(1.0f)));
    return $POW2MUL(p, n);
}

/* gate <- silu(gate) * up = gate / (1 + e^-gate) * up, elementwise over n floats. */
__attribute__((target($ISA))) static void silu_mul$SFX(float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i += $LANES) {
        const int64_t left = n - i < $LANES ? n - i : $LANES;
        const $VEC g = $LOADN(gate + i, left), u = $LOADN(up + i, left);
        const $VEC silu = $DIV(g, $ADD($SET1(1.0f), exp$SFX($SUB($ZERO(), g))));
        $STOREN(gate + i, $MUL(silu, u), left);
    }
}

/* RMSNorm (Zhang & Sennrich 2019) of each row of x [M, D]: out = w * (x / sqrt(mean(x^2) + eps)).
 * With delta, first x += delta (the residual connection), in place. Squares are summed in lanes
 * d mod L along the row, then a fixed reduction: independent of M. */
__attribute__((target($ISA))) static void rms_norm$SFX(float *x, const float *delta, const float *w, float *out,
                                                      int64_t M, int64_t D, float eps)
{
    for (int64_t m = 0; m < M; m++) {
        float *row = x + m * D;
        if (delta)
            for (int64_t d = 0; d < D; d++) row[d] = row[d] + delta[m * D + d];
        $VEC acc = $ZERO();
        for (int64_t d = 0; d < D; d += $LANES) {
            const $VEC v = $LOADN(row + d, D - d < $LANES ? D - d : $LANES);
            acc = $ADD(acc, $MUL(v, v));
        }
        const float scale = 1.0f / sqrtf($HSUM(acc) / (float)D + eps);
        for (int64_t d = 0; d < D; d++) out[m * D + d] = w[d] * (row[d] * scale);
    }
}

/* ======== attention of T new queries per row over the visible cache slots ========
 * One (batch row, kv head): q [T, H, D] (query heads kvh*G .. kvh*G+G-1 share this kv head);
 * keys kc [cap/16, D, 16] (blocks of 16 slots, d-major inside a block, so 16 slots are scored by
 * a stream of contiguous loads), values vc [cap, D], vis [S] (S = start + T; the new tokens sit at
 * slots start .. S-1). Query t sees slot s iff s <= start + t and vis[s]; with a token tree
 * (tree [T, T], tree[t][j] = 1 when new token j is t itself or one of its ancestors), a new slot
 * start + j only when also tree[t][j]: each token then sees its own path, as if decoded alone.
 * Exactness: each score is one chain of multiply-adds over d, whatever lane it sits in. A query's
 * keys are the visible slots in slot order, compacted; its softmax sum runs over that compacted
 * list in lanes j mod L, and its output sums p_j v_j in j order. Holes, padding, batch mates and
 * later tokens of the same pass therefore change nothing in its result. A query that sees no slot
 * (padding) gets zeros, never NaN. */
__attribute__((target($ISA))) static void attend$SFX(
    const float *q, const float *kc, const float *vc, const uint8_t *vis, const uint8_t *tree, float *out,
    int64_t T, int64_t H, int64_t G, int64_t D, int64_t kvh, int64_t start, float scale,
    float *scores, int64_t *idx, int64_t *seen)
{
    enum { QT = $QTILE, VB = SLOT_BLOCK / $LANES, DV = $DVECS };
    const int64_t S = start + T, Q = T * G;
    /* idx[t * S ..]: the slots token t sees, in slot order; seen[t]: how many */
    int64_t before = 0;
    for (int64_t s = 0; s < start; s++) if (vis[s]) idx[before++] = s;
    for (int64_t t = 0; t < T; t++) {
        int64_t *list = idx + t * S, n = before;
        if (t) for (int64_t j = 0; j < before; j++) list[j] = idx[j];
        for (int64_t j = 0; j <= t; j++)
            if (vis[start + j] && (!tree || tree[t * T + j])) list[n++] = start + j;
        seen[t] = n;
    }

    /* 1. scores[i, s] = (q_i . k_s) * scale for every slot: QT queries x one 16-slot block per tile */
    for (int64_t i0 = 0; i0 < Q; i0 += QT) {
        const int64_t count = Q - i0 < QT ? Q - i0 : QT;
        const float *qp[QT];
        for (int64_t j = 0; j < QT; j++) {
            const int64_t i = i0 + (j < count ? j : 0);  /* spare tile rows recompute query i0, unused */
            qp[j] = q + ((i / G) * H + kvh * G + i % G) * D;
        }
        for (int64_t s0 = 0; s0 < S; s0 += SLOT_BLOCK) {
            const float *block = kc + (s0 / SLOT_BLOCK) * D * SLOT_BLOCK;
            $VEC acc[QT][VB];
            for (int j = 0; j < QT; j++) for (int v = 0; v < VB; v++) acc[j][v] = $ZERO();
            for (int64_t d = 0; d < D; d++) {
                _Pragma("GCC unroll 2") for (int v = 0; v < VB; v++) {
                    const $VEC k = $LOAD(block + d * SLOT_BLOCK + v * $LANES);
                    _Pragma("GCC unroll 8") for (int j = 0; j < QT; j++) acc[j][v] = $FMA($SET1(qp[j][d]), k, acc[j][v]);
                }
            }
            for (int64_t j = 0; j < count; j++)
                for (int v = 0; v < VB; v++) {
                    const int64_t s = s0 + v * $LANES, left = S - s < $LANES ? S - s : $LANES;
                    if (left > 0) $STOREN(scores + (i0 + j) * S + s, $MUL(acc[j][v], $SET1(scale)), left);
                }
        }
    }
    /* 2. per query: compact its visible causal scores in place (row[j] <- row[idx[j]], j <= idx[j]),
     *    softmax them, keep the probabilities p_j in row[0 .. n) */
    for (int64_t i = 0; i < Q; i++) {
        const int64_t *list = idx + (i / G) * S, n = seen[i / G];
        float *row = scores + i * S;
        float top = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            row[j] = row[list[j]];
            if (row[j] > top) top = row[j];
        }
        $VEC sum = $ZERO();
        for (int64_t j = 0; j < n; j += $LANES) {
            const int64_t left = n - j < $LANES ? n - j : $LANES;
            const $VEC e = $KEEPN(exp$SFX($SUB($LOADN(row + j, left), $SET1(top))), left);
            $STOREN(row + j, e, left);
            sum = $ADD(sum, e);
        }
        const float inv = n ? 1.0f / $HSUM(sum) : 0.0f;
        for (int64_t j = 0; j < n; j++) row[j] = row[j] * inv;
    }
    /* 3. out_i = sum_j p_j v_idx[j] in j order; tiles of up to 4 query heads of one token (they
     *    share the slot list) x DV vectors of d, so each value vector loaded serves 4 queries */
    for (int64_t t = 0; t < T; t++) {
        const int64_t *list = idx + t * S, n = seen[t];
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t count = G - g0 < 4 ? G - g0 : 4;
            const float *p[4];
            for (int64_t j = 0; j < 4; j++) p[j] = scores + (t * G + g0 + (j < count ? j : 0)) * S;
            for (int64_t d0 = 0; d0 < D; d0 += DV * $LANES) {
                const int64_t chunks = (D - d0) / $LANES < DV ? (D - d0) / $LANES : DV;
                $VEC acc[4][DV];
                for (int j = 0; j < 4; j++) for (int c = 0; c < DV; c++) acc[j][c] = $ZERO();
                for (int64_t j = 0; j < n; j++) {
                    const float *v = vc + list[j] * D + d0;
                    if (chunks == DV) {
                        _Pragma("GCC unroll 4") for (int c = 0; c < DV; c++) {
                            const $VEC vv = $LOAD(v + c * $LANES);
                            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) acc[g][c] = $FMA($SET1(p[g][j]), vv, acc[g][c]);
                        }
                    } else {
                        for (int64_t c = 0; c < chunks; c++) {
                            const $VEC vv = $LOAD(v + c * $LANES);
                            for (int g = 0; g < 4; g++) acc[g][c] = $FMA($SET1(p[g][j]), vv, acc[g][c]);
                        }
                    }
                }
                for (int64_t g = 0; g < count; g++) {
                    float *o = out + (t * H + kvh * G + g0 + g) * D + d0;
                    for (int64_t c = 0; c < chunks; c++) $STORE(o + c * $LANES, acc[g][c]);
                }
            }
        }
    }
}
"""

_DRIVERS = r"""
/* ======== int4 weights x int8 activations on AVX-512 VNNI ========
 * The same int4 matrices, four times fewer instructions than unpacking to float: each activation
 * row is rounded to int8 per group of I4GROUP (scale = max|x| / 127, round to nearest even), and
 * one vpdpbusd multiplies 64 weight nibbles (0..15, unsigned) by 64 activation bytes into 16
 * int32 lanes, started from -8 * the lanes' activation sums so the lanes hold sum (q - 8) * x
 * exactly. A group then adds float(lanes) * (weight scale * activation scale) to the row's float
 * accumulator, in group order. Rounding x depends on x's own row only: rows stay independent.
 * qx [M, K] int8, qs [M, K / I4GROUP] float scales, qc [M, K / I4GROUP, 16] int32 starting lanes. */
typedef struct { const int8_t *qx; const float *qs; const int32_t *qc; const uint8_t *w; const float *s; const float *b;
                 float *y; int64_t M, N, K; } vnni_job;

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void quantize_rows_vnni(
    const float *x, int8_t *qx, float *qs, int32_t *qc, int64_t M, int64_t K)
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
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline __m512i nibbles_vnni(const uint8_t *p)
{
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)p), low = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low)),
                              _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low), 1);
}

#define TILE_VNNI(MR)                                                                              \
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void tile_vnni_##MR(                 \
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
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void linear_range_vnni(const void *arg, int64_t begin, int64_t end)
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
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void edge_vnni(const vnni_job *job, int64_t n)
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

/* ======== int4 weights x int8 activations on AVX2 ========
 * The arithmetic of the VNNI path above with AVX2's byte products: the activations are rounded to
 * int8 per group of I4GROUP the same way; vpmaddubsw multiplies 32 weight nibbles (unsigned) by 32
 * activation bytes into 16 int16 pair sums (at most 2 * 15 * 127, no saturation), the group's two
 * halves are added (at most 4 * 15 * 127) and vpmaddwd folds pairs into 8 int32 lanes, started from
 * -8 * the lanes' activation sums: lane l holds sum (q - 8) * x over weights 4l..4l+3 and
 * 32+4l..32+4l+3, exactly. About a third of the instructions of unpacking nibbles to float, which
 * leaves a 4-bit draft bound by memory instead of arithmetic on an AVX2 core.
 * qc [M, K / I4GROUP, 8] int32 starting lanes; qx and qs as above. */
__attribute__((target("avx2,fma"))) static inline __m256i q8lanes_avx2(__m256i start, __m256i wlo, __m256i whi, const int8_t *x)
{
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(wlo, _mm256_loadu_si256((const __m256i *)x)),
                                           _mm256_maddubs_epi16(whi, _mm256_loadu_si256((const __m256i *)(x + 32))));
    return _mm256_add_epi32(start, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* activation rows -> int8 per group (bitwise the VNNI path's rounding: x * (127 / amax), nearest even) */
__attribute__((target("avx2,fma"))) static void quantize_rows_avx2(const float *x, int8_t *qx, float *qs, int32_t *qc,
                                                                   int64_t M, int64_t K)
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

/* A tile: activation rows m0..m0+mr-1 (mr <= 4) against NR weight rows, over all groups; the sums
 * go to y[i * ldy + j] for tile row i and weight row j. */
/* A tile: activation rows m0..m0+mr-1 (mr <= Q8ROWS) against NR weight rows, over all groups; the
 * sums go to y[i * ldy + j] for tile row i and weight row j. Each weight row is unpacked and used
 * by every tile row before the next is loaded, so accumulators, one row's nibbles and temporaries
 * fit AVX2's 16 registers; the row count is a constant in each instance (a runtime count would
 * index the accumulators in memory: a store and a load per multiply-add). */
#define Q8ROWS 2
__attribute__((target("avx2,fma"), always_inline)) static inline void tile_q8avx2_rows(
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

__attribute__((target("avx2,fma"))) static void tile_q8avx2(const vnni_job *job, int64_t m0, int mr, const uint8_t *w,
                                                            const float *s, float *y, int64_t ldy, const char *next)
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

/* Several products of one x (a layer's q, k and v, or gate and up) as one job over all their weight
 * tiles: one wake of the pool, one rounding of x. */
#define MAX_GROUP 4
typedef struct { range_fn fn; const void *jobs[MAX_GROUP]; int64_t first[MAX_GROUP + 1]; int count; } group_job;

static void group_range(const void *arg, int64_t begin, int64_t end)
{
    const group_job *group = arg;
    for (int i = 0; i < group->count; i++) {
        const int64_t lo = begin > group->first[i] ? begin : group->first[i];
        const int64_t hi = end < group->first[i + 1] ? end : group->first[i + 1];
        if (lo < hi) group->fn(group->jobs[i], lo - group->first[i], hi - group->first[i]);
    }
}

static void run_group(range_fn fn, const void *const *jobs, const int64_t *tiles, int count, int64_t work, int threads)
{
    group_job group = {fn, {0}, {0}, count};
    for (int i = 0; i < count; i++) {
        group.jobs[i] = jobs[i];
        group.first[i + 1] = group.first[i] + tiles[i];
    }
    const int64_t total = group.first[count];
    /* ~64 chunks per call balance threads; below ~64k multiply-adds one thread is quicker than waking another */
    const int64_t grain = work < 65536 ? total : (total + 63) / 64;
    if (total) parallel_for(group_range, &group, total, grain > 0 ? grain : 1, threads);
}

/* The shared start of the int8-activation int4 products: x rounded to int8 per group by `quantize` into
 * one scratch block (qx [M, K], `lanes` int32 starting lanes and a float scale per row and group), then
 * `count` products of that x as one job over all their weight tiles (one wake of the pool). Fills jobs
 * and tiles for the caller's edge rows; returns the scratch for the caller to free, 0 if memory ran out. */
typedef void (*quantize_fn)(const float *, int8_t *, float *, int32_t *, int64_t, int64_t);
static int8_t *int4_group_run(quantize_fn quantize, int lanes, range_fn range, vnni_job *jobs, int64_t *tiles,
                              const float *x, int count, const uint8_t *const *w, const float *const *s,
                              const float *const *b, float *const *y, const int64_t *N, int64_t M, int64_t K, int threads)
{
    const int64_t groups = K / I4GROUP;
    const size_t bytes = (size_t)(M * K + M * groups * (lanes * 4 + 4));
    int8_t *qx = aligned_alloc(64, (bytes + 63) / 64 * 64);  /* a whole number of alignments, as C11 asks */
    if (!qx) return 0;
    int32_t *qc = (int32_t *)(qx + M * K);
    float *qs = (float *)(qc + M * groups * lanes);
    quantize(x, qx, qs, qc, M, K);
    const void *job_ptrs[MAX_GROUP];
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

/* int4 products on AVX-512 VNNI (activations rounded by quantize_rows_vnni), a group as one job; each
 * output is bitwise what the product alone gives. 0 when the scratch memory ran out. */
static int linear_vnni_group(const float *x, int count, const uint8_t *const *w, const float *const *s, const float *const *b,
                             float *const *y, const int64_t *N, int64_t M, int64_t K, int threads)
{
    vnni_job jobs[MAX_GROUP];
    int64_t tiles[MAX_GROUP];
    int8_t *qx = int4_group_run(quantize_rows_vnni, 16, linear_range_vnni, jobs, tiles, x, count, w, s, b, y, N, M, K, threads);
    if (!qx) return 0;
    for (int i = 0; i < count; i++)
        for (int64_t n = tiles[i] * NR; n < N[i]; n++) edge_vnni(&jobs[i], n);
    free(qx);
    return 1;
}

/* The same on AVX2 (quantize_rows_avx2, vpmaddubsw). 0 when the scratch memory ran out. The last N % NR
 * weight rows run as a tile of NR whose extra rows repeat the last one (each output is a function of its
 * own weight row: nothing else changes). */
static int linear_q8avx2(const float *x, int count, const uint8_t *const *w, const float *const *s, const float *const *b,
                         float *const *y, const int64_t *N, int64_t M, int64_t K, int threads)
{
    const int64_t groups = K / I4GROUP;
    vnni_job jobs[MAX_GROUP];
    int64_t tiles[MAX_GROUP];
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

/* ======== float32 matrices in 16-row panels (`PanelMatrix`), AVX2+FMA ========
 * w is stored [ceil(N / 16)][K][16]: for each k, 16 output rows' weights side by side, so a pass
 * reads the matrix as one contiguous stream (the hardware prefetcher follows it at full speed) and
 * a tile broadcasts x[m, k] against two 8-wide weight vectors (the GEMM microkernel's shape). Each
 * y[m, n] is the blocked GEMM's chain: per block of PKC k, one lane summing x[m, k] * w[n, k] by
 * fused multiply-adds in k order from 0; y = (b[n] or 0) + block 0, then y += each next block. Which
 * tile ran (how many rows, one panel or two) only decides which lanes were live together: a row's
 * result is bitwise the same for any M and any other rows, and the same as blocked_linear_group's
 * (a prefill). K needs no multiple of 8 and no tail. Rows past 6 go in further passes over the same
 * k block of the panel, now in L1, while the next block is prefetched. */
#define PNR 16     /* output rows per panel */
#define PKC 256    /* k per block: a panel's block is 16 KB; the GEMM's GKC, for the same sums */
#define PMR 6      /* activation rows per pass */

#define PANEL_TILE(MR, P)                                                                          \
__attribute__((target("avx2,fma"))) static void panel_tile_##MR##x##P(                           \
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
__attribute__((target("avx2,fma"))) static void panel_run(const panel_job *job, int part, int64_t p, int P, float *acc)
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
__attribute__((target("avx2,fma"))) static void panel_range(const void *arg, int64_t begin, int64_t end)
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
static int panel_linear_group(const float *x, int count, const void *const *w, const float *const *b, float *const *y,
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

int kernels_isa(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 256;
    return 0;
}

int kernels_vnni(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

/* weights: 0 = float32, 1 = bfloat16 (stored as uint16; converted exactly, accumulated in float32),
 * 2 = int8 with a float32 scale per row in s (accumulated in float32, scaled once at the end),
 * 3 = int4 in groups of I4GROUP along k, a float32 scale per group in s [N, K / I4GROUP],
 * 4 = the same int4 matrices with activations rounded to int8 per group (AVX-512 VNNI),
 * 5 = the same on AVX2 (byte products through vpmaddubsw),
 * 6 = exact Q4_K blocks, 7 = exact Q6_K blocks (see widen_q4k / widen_q6k; s holds their scales),
 * 8 = float32 in 16-row panels (see panel_linear_group; AVX2+FMA, whatever `isa` says).
 * A group is `count` (at most MAX_GROUP) matrices of one format and width K applied to the same x,
 * y[i] = x w[i]^T, as one job. Returns 0, or -1 if scratch memory ran out. */
int rowwise_linear_group(const float *x, int count, const void *const *w, const float *const *s, const float *const *b,
                         float *const *y, const int64_t *N, int64_t M, int64_t K, int weights, int isa, int threads)
{
    if (count < 1 || count > MAX_GROUP) return -1;
    if (weights == 4) return linear_vnni_group(x, count, (const uint8_t *const *)w, s, b, y, N, M, K, threads) ? 0 : -1;
    if (weights == 5) return linear_q8avx2(x, count, (const uint8_t *const *)w, s, b, y, N, M, K, threads) ? 0 : -1;
    if (weights == 8) return panel_linear_group(x, count, w, b, y, N, M, K, threads);
    linear_job jobs[MAX_GROUP];
    const void *job_ptrs[MAX_GROUP];
    int64_t tiles[MAX_GROUP], work = 0;
    for (int i = 0; i < count; i++) {
        jobs[i] = (linear_job){x, w[i], s[i], b[i], y[i], M, N[i], K};
        job_ptrs[i] = &jobs[i];
        tiles[i] = N[i] / NR;
        work += M * N[i] * K;
    }
    const range_fn ranges[2][8] = {{linear_range256f32, linear_range256bf16, linear_range256i8, linear_range256i4, 0, 0,
                                    linear_range256q4k, linear_range256q6k},
                                   {linear_range512f32, linear_range512bf16, linear_range512i8, linear_range512i4, 0, 0,
                                    linear_range512q4k, linear_range512q6k}};
    if (weights < 0 || weights > 7 || !ranges[0][weights]) return -1;
    run_group(ranges[isa == 512][weights], job_ptrs, tiles, count, work, threads);
    for (int i = 0; i < count; i++)
        for (int64_t n = tiles[i] * NR; n < N[i]; n++) {
            const float *bn = b[i] ? b[i] + n : 0, *sn = s[i] ? s[i] + n : 0;
            float *yn = y[i] + n;
            const int64_t Ni = N[i];
            if (weights == 6 || weights == 7) {  /* one exact k-quant row: widen it whole, then float32 */
                float *wide = malloc(sizeof(float) * (size_t)(K ? K : 1));
                if (!wide) return -1;
                if (weights == 6) widen_q4k((const uint8_t *)w[i] + n * (K / 2), s[i] + n * (K / 16), K, 1, 0, K, wide, 0);
                else widen_q6k((const int8_t *)w[i] + n * K, s[i] + n * (K / 16), K, 1, 0, K, wide, 0);
                (isa == 512 ? edge512f32 : edge256f32)(x, wide, sn, bn, yn, M, Ni, K);
                free(wide);
            } else if (weights == 3)
                (isa == 512 ? edge512i4 : edge256i4)(x, (const uint8_t *)w[i] + n * (K / 2), s[i] + n * (K / I4GROUP), bn, yn, M, Ni, K);
            else if (weights == 2) (isa == 512 ? edge512i8 : edge256i8)(x, (const int8_t *)w[i] + n * K, sn, bn, yn, M, Ni, K);
            else if (weights == 1) (isa == 512 ? edge512bf16 : edge256bf16)(x, (const uint16_t *)w[i] + n * K, sn, bn, yn, M, Ni, K);
            else (isa == 512 ? edge512f32 : edge256f32)(x, (const float *)w[i] + n * K, sn, bn, yn, M, Ni, K);
        }
    return 0;
}

/* The first row of the exact k-quant matrix (weights 6 or 7) whose rebuilt weights differ from
 * `dense` [N, K] in any bit; N when none does; -1 when scratch memory ran out. */
int64_t exact_blocks_mismatch(const void *w, const float *s, const float *dense, int64_t N, int64_t K, int weights)
{
    float *wide = malloc(sizeof(float) * (size_t)(K ? K : 1));
    if (!wide) return -1;
    int64_t n = 0;
    for (; n < N; n++) {
        if (weights == 6) widen_q4k((const uint8_t *)w + n * (K / 2), s + n * (K / 16), K, 1, 0, K, wide, 0);
        else widen_q6k((const int8_t *)w + n * K, s + n * (K / 16), K, 1, 0, K, wide, 0);
        if (memcmp(wide, dense + n * K, sizeof(float) * (size_t)K)) break;
    }
    free(wide);
    return n;
}

void int4_quantize(const float *w, uint8_t *packed, float *scale, const float *shrinks, int64_t N, int64_t K, int count, int isa,
                   int threads)
{
    const quantize_job job = {w, packed, scale, shrinks, K, count};
    parallel_for(isa == 512 ? int4_quantize_rows512 : int4_quantize_rows256, &job, N, 16, threads);
}

int rowwise_linear(const float *x, const void *w, const float *s, const float *b, float *y, int64_t M, int64_t N,
                   int64_t K, int weights, int isa, int threads)
{
    return rowwise_linear_group(x, 1, &w, &s, &b, &y, &N, M, K, weights, isa, threads);
}

void silu_mul(float *gate, const float *up, int64_t n, int isa)
{
    if (isa == 512) silu_mul512(gate, up, n); else silu_mul256(gate, up, n);
}

void rms_norm(float *x, const float *delta, const float *w, float *out, int64_t M, int64_t D, float eps, int isa)
{
    if (isa == 512) rms_norm512(x, delta, w, out, M, D, eps); else rms_norm256(x, delta, w, out, M, D, eps);
}

/* Rotary embedding (Su et al. 2021), half-split layout as in transformers, in place on x [M, heads * D]
 * (row stride ld): x*cos + rotate_half(x)*sin with cos/sin rows picked by position. Elementwise,
 * rounded exactly as transformers' mul/neg/mul/add sequence. */
void rope(float *x, int64_t M, int64_t ld, int64_t heads, int64_t D, const int64_t *positions,
          const float *cos_table, const float *sin_table)
{
    const int64_t half = D / 2;
    for (int64_t m = 0; m < M; m++) {
        const float *c = cos_table + positions[m] * D, *s = sin_table + positions[m] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + m * ld + h * D;
            for (int64_t d = 0; d < half; d++) {
                const float a = v[d], b = v[d + half];
                v[d] = a * c[d] + (-b) * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}

/* New keys k [B, T, KVH, D] -> kc [B, KVH, cap/16, D, 16] at slots start..start+T-1 (16-slot
 * blocks, d-major inside, for attention's slot-parallel scores); values v [B, T, KVH, D] ->
 * vc [B, KVH, cap, D]. */
void cache_write(const float *k, const float *v, float *kc, float *vc, int64_t B, int64_t T, int64_t KVH,
                 int64_t D, int64_t cap, int64_t start)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t s = start + t;
                const float *ks = k + ((b * T + t) * KVH + h) * D, *vs = v + ((b * T + t) * KVH + h) * D;
                float *kd = kc + (b * KVH + h) * D * cap + (s / SLOT_BLOCK) * D * SLOT_BLOCK + s % SLOT_BLOCK;
                float *vd = vc + ((b * KVH + h) * cap + s) * D;
                for (int64_t d = 0; d < D; d++) { kd[d * SLOT_BLOCK] = ks[d]; vd[d] = vs[d]; }
            }
}

/* (batch row, kv head) pairs [begin, end) of an attention_job. */
static void attention_range(const void *arg, int64_t begin, int64_t end, int isa)
{
    attention_job *job = (attention_job *)arg;
    const int64_t T = job->T, H = job->H, KVH = job->KVH, D = job->D, G = H / KVH, S = job->start + T;
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(T * S + T) + sizeof(float) * (size_t)(T * G * S));
    if (!idx) { job->failed = 1; return; }
    int64_t *seen = idx + T * S;
    float *scores = (float *)(seen + T);
    for (int64_t pair = begin; pair < end; pair++) {
        const int64_t b = pair / KVH, kvh = pair % KVH;
        (isa == 512 ? attend512 : attend256)(job->q + b * T * H * D, job->kc + pair * D * job->cap,
                                             job->vc + pair * job->cap * D, job->vis + b * job->vis_stride,
                                             job->tree ? job->tree + b * T * T : NULL,
                                             job->out + b * T * H * D, T, H, G, D, kvh, job->start, job->scale,
                                             scores, idx, seen);
    }
    free(idx);
}
static void attention_range512(const void *job, int64_t begin, int64_t end) { attention_range(job, begin, end, 512); }
static void attention_range256(const void *job, int64_t begin, int64_t end) { attention_range(job, begin, end, 256); }

/* q [B, T, H, D], out [B, T, H, D]; kc [B, KVH, cap/16, D, 16]; vc [B, KVH, cap, D]; vis [B, vis_stride].
 * Returns 0, or -1 if scratch memory ran out. Threads split the (batch row, kv head) pairs. */
int slot_attention(const float *q, const float *kc, const float *vc, const uint8_t *vis, const uint8_t *tree, float *out,
                   int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t cap,
                   int64_t vis_stride, int64_t start, float scale, int isa, int threads)
{
    attention_job job = {q, kc, vc, vis, tree, out, B, T, H, KVH, D, cap, vis_stride, start, scale, 0};
    const int small = T * (start + T) * H * D < 65536;
    parallel_for(isa == 512 ? attention_range512 : attention_range256, &job, B * KVH, 1, small ? 1 : threads);
    return job.failed ? -1 : 0;
}

/* One product of a decoder layer: `count` matrices of one weight format and width K applied to the
 * same x (rowwise_linear_group's arguments, kept for every step). */
typedef struct {
    int count, weights;
    int64_t K;
    const void *w[MAX_GROUP];
    const float *s[MAX_GROUP], *b[MAX_GROUP];
    int64_t N[MAX_GROUP];
} layer_product;

typedef struct {
    const float *attn_norm, *mlp_norm;
    layer_product qkv, o, gate_up, down;
} layer_desc;

static int layer_product_run(const layer_product *p, const float *x, float *const *y, int64_t M, int isa, int threads)
{
    return rowwise_linear_group(x, p->count, p->w, p->s, p->b, y, p->N, M, p->K, p->weights, isa, threads);
}

/* Every decoder layer of a small pass as one call: the calls a Python loop over the layers would make
 * (RMSNorm, q/k/v, RoPE, cache write, slot attention, o, RMSNorm, gate/up, SwiGLU, down), in the same
 * order on the same buffers, so bitwise the same numbers, without ~10 Python-to-C crossings per layer
 * and with the thread pool kept busy from one product to the next.
 * x [M = B * T, hidden]: the residual stream, updated in place; buffers (each [M, width], contiguous):
 * normed, delta, q, k, v, attended, gate, up. On return delta holds the last layer's MLP output, not yet
 * added to x (the final norm adds it). Layer l's keys are at kc + l * kc_stride ([B, KVH, cap/16, D, 16]),
 * its values at vc + l * vc_stride ([B, KVH, cap, D]). Returns 0, or -1 if scratch memory ran out. */
int decoder_layers(const layer_desc *layers, int64_t count, float *x, float *const *buffers,
                   int64_t B, int64_t T, int64_t hidden, int64_t H, int64_t KVH, int64_t D,
                   const int64_t *positions, const float *cos_table, const float *sin_table,
                   float *kc, int64_t kc_stride, float *vc, int64_t vc_stride, int64_t cap,
                   const uint8_t *vis, int64_t vis_stride, const uint8_t *tree, int64_t start,
                   float scale, float eps, int isa, int threads)
{
    const int64_t M = B * T;
    float *normed = buffers[0], *delta = buffers[1], *q = buffers[2], *k = buffers[3], *v = buffers[4];
    float *attended = buffers[5], *gate = buffers[6], *up = buffers[7];
    float *const qkv[3] = {q, k, v}, *const gate_up[2] = {gate, up};
    for (int64_t l = 0; l < count; l++) {
        const layer_desc *layer = layers + l;
        float *keys = kc + l * kc_stride, *values = vc + l * vc_stride;
        rms_norm(x, l ? delta : 0, layer->attn_norm, normed, M, hidden, eps, isa);  /* x += the last MLP output first */
        if (layer_product_run(&layer->qkv, normed, qkv, M, isa, threads)) return -1;
        rope(q, M, H * D, H, D, positions, cos_table, sin_table);
        rope(k, M, KVH * D, KVH, D, positions, cos_table, sin_table);
        cache_write(k, v, keys, values, B, T, KVH, D, cap, start);
        if (slot_attention(q, keys, values, vis, tree, attended, B, T, H, KVH, D, cap, vis_stride, start, scale, isa, threads))
            return -1;
        if (layer_product_run(&layer->o, attended, &delta, M, isa, threads)) return -1;
        rms_norm(x, delta, layer->mlp_norm, normed, M, hidden, eps, isa);
        if (layer_product_run(&layer->gate_up, normed, gate_up, M, isa, threads)) return -1;
        silu_mul(gate, up, M * layer->gate_up.N[0], isa);
        if (layer_product_run(&layer->down, gate, &delta, M, isa, threads)) return -1;
    }
    return 0;
}
"""


_WEIGHTS = {
    "f32": {"$WT": "float", "$WLOADN": "$LOADN", "$WLOAD": "$LOAD", "$WSCALE": "_unscaled"},
    "bf16": {"$WT": "uint16_t", "$WLOADN": "bf16loadn$SFX", "$WLOAD": "bf16load$SFX", "$WSCALE": "_unscaled"},
    "i8": {"$WT": "int8_t", "$WLOADN": "i8loadn$SFX", "$WLOAD": "i8load$SFX", "$WSCALE": "_scaled"},
}


def _replace(text: str, table: dict[str, str]) -> str:
    for placeholder in sorted(table, key=len, reverse=True):
        text = text.replace(placeholder, table[placeholder])
    return text


def _instantiate(isa: str) -> str:
    linear = "".join(_replace(_LINEAR_TEMPLATE, {**_WEIGHTS[w], "$W": w}) for w in _WEIGHTS)
    return _replace(_ISA_HELPERS[isa] + linear + _EXACT_TEMPLATE + _INT4_TEMPLATE + _TEMPLATE, _ISAS[isa])


_SOURCE = _PREAMBLE + _EXACT_WIDEN + _instantiate("512") + _instantiate("256") + _DRIVERS + _BLOCKED
_FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off"]
_LIBS = ["-lm"]

_library: ctypes.CDLL | None = None
_isa = 0
_vnni = False  # AVX-512 VNNI present (used for int4 matrices when _int8_activations)
_int8_activations = False  # int4 matrices multiply int8-rounded activations (see the C comments)
_tried = False


def _cache_dir() -> Path:
    from verispec.zoo import home

    return home() / "kernels"


def _build() -> Path:
    """Compile _SOURCE once per source text; the file name carries its hash, so edits rebuild."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) on PATH")
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS + _LIBS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kernels_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "kernels.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built), *_LIBS], check=True, capture_output=True, text=True)
        os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
    for stale in target.parent.glob("kernels_*.so"):  # builds of older sources (unlinking is safe if mapped)
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


_SIGNATURES = {
    "kernels_isa": (ctypes.c_int, []),
    "kernels_vnni": (ctypes.c_int, []),
    "rowwise_linear": (ctypes.c_int, [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3),
    "rowwise_linear_group": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3),
    "exact_blocks_mismatch": (ctypes.c_int64, [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]),
    "silu_mul": (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int]),
    "int4_quantize": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3),
    "rms_norm": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]),
    "rope": (None, [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3),
    "cache_write": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6),
    "blocked_linear_group": (None, [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int]),
    "slot_attention": (ctypes.c_int, [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float] + [ctypes.c_int] * 2),
    "decoder_layers": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 6
                       + [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 2
                       + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                       + [ctypes.c_float] * 2 + [ctypes.c_int] * 2),
}


def _load() -> None:
    global _library, _isa, _tried, _vnni, _int8_activations
    if _tried:
        return
    _tried = True
    if os.environ.get("VERISPEC_NO_KERNELS"):
        return
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("verispec: C kernels unavailable, small passes use PyTorch (%s)", detail.strip()[:300])
        return
    for name, (restype, argtypes) in _SIGNATURES.items():
        getattr(library, name).restype = restype
        getattr(library, name).argtypes = argtypes
    isa = library.kernels_isa()
    wanted = os.environ.get("VERISPEC_KERNEL_ISA")  # "256" forces the AVX2 variant (tests, comparisons)
    if wanted and int(wanted) <= isa:
        isa = int(wanted)
    _library, _isa = (library, isa) if isa else (None, 0)
    _vnni = bool(isa == 512 and library.kernels_vnni())
    # VERISPEC_INT4_FLOAT=1 keeps int4 drafts on the float path (unpacked weights x float32 activations)
    _int8_activations = bool(isa and not os.environ.get("VERISPEC_INT4_FLOAT") and not os.environ.get("VERISPEC_NO_VNNI"))


def available() -> bool:
    """Whether the kernels run here (C compiler present, CPU with AVX2+FMA or AVX-512)."""
    _load()
    return _library is not None


def isa() -> int:
    """Vector width in bits the kernels use: 512, 256, or 0 when unavailable."""
    _load()
    return _isa


def lanes() -> int:
    """Floats per vector: head sizes must be a multiple of this for `slot_attention`."""
    return 16 if isa() == 512 else 8


def _check(*tensors: torch.Tensor) -> None:
    if _library is None and not available():
        raise RuntimeError("verispec C kernels unavailable here: check kernels.available() and use PyTorch ops")
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the kernels take contiguous float32 CPU tensors")


def _check_masks(visible: torch.Tensor, tree: torch.Tensor | None, batch: int, width: int) -> None:
    """The attention masks the C kernels read: visible [batch, >= slots] bool with unit column stride, tree
    (or None) [batch, width, width] contiguous bool."""
    if visible.dtype != torch.bool or visible.stride(-1) != 1:
        raise ValueError("visible must be a bool matrix with unit column stride")
    if tree is not None and (tree.dtype != torch.bool or tuple(tree.shape) != (batch, width, width) or not tree.is_contiguous()):
        raise ValueError(f"tree must be a contiguous bool tensor [{batch}, {width}, {width}]")


class QuantizedMatrix:
    """Integer weight codes `values` and float32 `scale`s standing for a float matrix [N, K]; rows
    are output features. Subclasses define the format (`quantize`, `dequantize`, `shape`, `dtype`)."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor):
        self.values, self.scale = values, scale
        self._widened: dict[torch.dtype, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.values.device

    def is_contiguous(self) -> bool:
        return self.values.is_contiguous() and self.scale.is_contiguous()

    def __getitem__(self, rows) -> "QuantizedMatrix":
        """A subset of output rows (e.g. a restricted vocabulary), as a new matrix."""
        return type(self)(self.values[rows].contiguous(), self.scale[rows].contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """`dequantize(dtype)`, computed on the first call and kept: big passes (prefill) multiply it
        (for a 0.5B draft, widening at every prefill cost ~1 s; the bfloat16 copy is 1 GB)."""
        if dtype not in self._widened:
            self._widened[dtype] = self.dequantize(dtype)
        return self._widened[dtype]


class Int8Matrix(QuantizedMatrix):
    """Weight-only int8 storage: w[n, k] ~ values[n, k] * scale[n], symmetric, one scale per output row.

    A quarter of float32's bytes. Only the weights are rounded (once, at load); activations stay
    float32 and are never quantized, so each output row still depends on its own input row alone.
    values [N, K] int8, scale [N] float32.
    """

    dtype = torch.int8

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Matrix":
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        values = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(values.contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.values.to(dtype) * self.scale[:, None].to(dtype)


class Int4Matrix(QuantizedMatrix):
    """Weight-only 4-bit storage in groups: w[n, k] ~ (values - 8) * scale[n, k // GROUP], symmetric.

    Two weights per byte: byte j of a group of `GROUP` weights holds weight j (low nibble) and weight
    j + GROUP/2 (high nibble), the layout the kernels unpack. About a seventh of float32's bytes
    with the scales (0.5625 bytes per weight). values [N, K / 2] uint8, scale [N, K / GROUP] float32.
    """

    GROUP = 64
    dtype = torch.quint4x2  # the tag for this format: two 4-bit values per byte

    # Each group's scale: of a few clipping ranges (amax/7 shrunk by up to 30%), the one with the least
    # squared rounding error; clipping a lone outlier often serves the other 63 weights better.
    SHRINKS = torch.linspace(1.0, 0.7, 7)  # at most 16 (I4MAXSHRINKS in the C quantizer)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int4Matrix":
        n, k = weight.shape
        if k % cls.GROUP:
            raise ValueError(f"int4 weights need in_features divisible by {cls.GROUP}, got {k}: use int8")
        if not available():
            return cls.quantize_reference(weight)
        weight = weight.detach().float().contiguous()
        packed = torch.empty(n, k // 2, dtype=torch.uint8)
        scale = torch.empty(n, k // cls.GROUP)
        _library.int4_quantize(weight.data_ptr(), packed.data_ptr(), scale.data_ptr(), cls.SHRINKS.data_ptr(), n, k,
                               len(cls.SHRINKS), isa(), torch.get_num_threads())
        return cls(packed, scale)

    @classmethod
    def quantize_reference(cls, weight: torch.Tensor) -> "Int4Matrix":
        """`quantize` in PyTorch ops (where the C kernels are unavailable; the tests compare both)."""
        n, k = weight.shape
        groups = weight.detach().float().reshape(n, k // cls.GROUP, cls.GROUP)
        peak = groups.abs().amax(dim=2).clamp(min=1e-12)
        scale, best = peak / 7.0, None
        for shrink in cls.SHRINKS.tolist():
            candidate = peak * shrink / 7.0
            rounded = torch.round(groups * (1.0 / candidate)[..., None]).clamp(-8, 7) * candidate[..., None]
            error = (rounded - groups).pow(2).sum(dim=2)
            if best is None:
                best = error
            else:
                better = error < best
                scale, best = torch.where(better, candidate, scale), torch.where(better, error, best)
        q = (torch.round(groups * (1.0 / scale)[..., None]).clamp(-8, 7) + 8).to(torch.uint8)
        half = cls.GROUP // 2
        packed = q[..., :half] | (q[..., half:] << 4)
        return cls(packed.reshape(n, k // 2).contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.values.shape[0], self.values.shape[1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, half = self.values.shape[0], self.GROUP // 2
        packed = self.values.reshape(n, -1, half)
        q = torch.cat((packed & 15, packed >> 4), dim=2).to(torch.float32) - 8
        return (q * self.scale[..., None]).reshape(n, -1).to(dtype)


class ExactBlocks(QuantizedMatrix):
    """A float32 matrix kept as the GGUF k-quant blocks it was dequantized from, with the float32 matrix
    itself (`dense`, shared, not copied) for big passes. The kernels rebuild every weight with the
    operations of gguf's reference dequantizer, rounded alike, and then run the float32 arithmetic:
    a product is bit for bit the float32 matrix's, from a fifth (Q4_K) to a third (Q6_K) of its bytes
    per token. Unlike the draft formats above, a target may use these. `build` checks every weight
    against `dense` and returns None if any bit differs."""

    dtype = torch.float32  # the numbers are the float32 matrix's
    code = -1  # the C kernels' weight format

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, dense: torch.Tensor):
        super().__init__(values, scale)
        self.dense = dense

    @classmethod
    def build(cls, values: torch.Tensor, scale: torch.Tensor, dense: torch.Tensor) -> "ExactBlocks | None":
        """The blocks as a matrix standing for `dense` [N, K], or None unless they rebuild it exactly."""
        n, k = dense.shape
        if k % 256 or not available():
            return None
        values, scale = values.contiguous(), scale.contiguous()
        _check(dense, scale)
        if values.device.type != "cpu" or values.numel() * (2 if cls.code == 6 else 1) != n * k or scale.numel() * 16 != n * k:
            raise ValueError(f"blocks of {cls.__name__} do not cover a [{n}, {k}] matrix")
        first = _library.exact_blocks_mismatch(values.data_ptr(), scale.data_ptr(), dense.data_ptr(), n, k, cls.code)
        if first < 0:
            raise MemoryError("exact_blocks_mismatch: out of memory for its scratch row")
        return cls(values, scale, dense) if first == n else None

    @property
    def shape(self) -> torch.Size:
        return self.dense.shape

    def __getitem__(self, rows) -> "ExactBlocks":
        return type(self)(self.values[rows].contiguous(), self.scale[rows].contiguous(), self.dense[rows].contiguous())

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dense if dtype == torch.float32 else self.dense.to(dtype)


class Q4KMatrix(ExactBlocks):
    """Q4_K: codes [N, K / 2] uint8 in 64-weight groups (byte j: weight j low, weight j + 32 high, the
    super-block order), scale [N, K / 32, 2] each 32 weights' (scale, min); w = (scale * q) - min."""

    code = 6

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n = self.values.shape[0]
        packed = self.values.reshape(n, -1, 32)
        q = torch.stack((packed & 15, packed >> 4), dim=2).reshape(n, -1, 32).to(torch.float32)
        pairs = self.scale.reshape(n, -1, 2)
        return (pairs[..., 0:1] * q - pairs[..., 1:2]).reshape(n, -1).to(dtype)


class Q6KMatrix(ExactBlocks):
    """Q6_K: codes [N, K] int8 in [-32, 31], scale [N, K / 16] one per 16 weights; w = scale * q."""

    code = 7

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n = self.values.shape[0]
        q = self.values.reshape(n, -1, 16).to(torch.float32)
        return (self.scale.reshape(n, -1, 1) * q).reshape(n, -1).to(dtype)


class PanelMatrix(QuantizedMatrix):
    """A float32 matrix [N, K] stored in panels of 16 rows, k-major: values [ceil(N / 16), K, 16], rows
    past N zero. The same numbers as the float32 matrix (nothing is rounded), in the order the AVX2
    kernels read them: a small pass streams the matrix front to back, which on 2 Zen 3 cores ran a
    one-row pass at the memory's speed and kept 8-16-row passes within ~1.3-1.8x of it (row-major
    tiles: 1.45-2.3x), and prefill's GEMM uses the panels in place instead of packing them per call.
    Each output row of a pass is bitwise the same whatever the other rows (see panel_linear_group),
    though it differs in the last bits from a row-major float32 product (another summation order)."""

    dtype = torch.float32  # the numbers are the float32 matrix's
    ROWS = 16

    def __init__(self, values: torch.Tensor, scale: torch.Tensor | None = None, rows: int | None = None):
        super().__init__(values, torch.empty(0) if scale is None else scale)
        self.rows = values.shape[0] * self.ROWS if rows is None else rows

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "PanelMatrix":
        n, k = weight.shape
        padded = -(-n // cls.ROWS) * cls.ROWS
        w = weight.detach().float()
        if padded != n:
            w = torch.cat((w, w.new_zeros(padded - n, k)))
        return cls(w.view(padded // cls.ROWS, cls.ROWS, k).transpose(1, 2).contiguous(), rows=n)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.values.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k = self.values.shape[1]
        return self.values.transpose(1, 2).reshape(-1, k)[: self.rows].to(dtype).contiguous()

    def __getitem__(self, rows) -> "PanelMatrix":
        return self.pack(self.dequantize()[rows])


def panels_preferred() -> bool:
    """Whether float32 matrices of small passes should be `PanelMatrix`es: on CPUs whose widest vectors
    are AVX2's and big passes use the blocked GEMM, which reads the panels in place (the panel kernels are
    AVX2+FMA code, measured there). VERISPEC_PANELS=0 keeps row-major matrices."""
    return blocked_preferred() and os.environ.get("VERISPEC_PANELS", "1") != "0"


class Linear:
    """A weight matrix (and bias) checked once, for a hot loop: `linear(x, out)` computes what
    `rowwise_linear(x, weight, bias, out)` does without re-checking the weight on every call.
    x [M, K] and out [M, N] must be contiguous float32 CPU tensors (the caller's own buffers)."""

    __slots__ = ("weight", "bias", "n", "k", "_matrix", "_scale", "_bias", "_format")

    def __init__(self, weight, bias: torch.Tensor | None = None):
        self.n, self.k = weight.shape
        if bias is not None:
            _check(bias)
        if isinstance(weight, QuantizedMatrix):
            _check(weight.scale)
            matrix, self._scale = weight.values, weight.scale.data_ptr()
            if isinstance(weight, ExactBlocks):
                self._format = "q4k" if weight.code == 6 else "q6k"
            elif isinstance(weight, PanelMatrix):
                self._format, self._scale = "panels", None
            else:
                self._format = "int8" if isinstance(weight, Int8Matrix) else "int4"
        else:
            if weight.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError("weight must be a float32 or bfloat16 matrix, an Int8Matrix or an Int4Matrix")
            matrix, self._scale, self._format = weight, None, "bf16" if weight.dtype == torch.bfloat16 else "f32"
        if not matrix.is_contiguous() or matrix.device.type != "cpu":
            raise ValueError("weight must be a contiguous CPU matrix")
        self.weight, self.bias = weight, bias  # kept alive: the pointers below point into them
        self._matrix, self._bias = matrix.data_ptr(), None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # the C kernel's weight codes; int4 takes an int8-activation path unless told not to
        kind = _FORMAT_CODES[self._format] if self._format != "int4" else _int4_code()
        if _library.rowwise_linear(x.data_ptr(), self._matrix, self._scale, self._bias, out.data_ptr(), x.shape[0],
                                   self.n, self.k, kind, _isa, torch.get_num_threads()):
            raise MemoryError("rowwise_linear: out of memory for its scratch buffer")
        return out


class _GroupCall:
    """One C call of a `LinearGroup`: its linears of one weight format, as the argument arrays the call takes."""

    __slots__ = ("index", "first", "count", "weights", "scales", "biases", "widths", "out_ptrs", "outs")

    def __init__(self, index: list[int], members: list["Linear"]):
        count = len(members)
        self.index, self.first, self.count = index, members[0], count
        self.weights = (ctypes.c_void_p * count)(*(lin._matrix for lin in members))
        self.scales = (ctypes.c_void_p * count)(*(lin._scale for lin in members))
        self.biases = (ctypes.c_void_p * count)(*(lin._bias for lin in members))
        self.widths = (ctypes.c_int64 * count)(*(lin.n for lin in members))
        self.out_ptrs = (ctypes.c_void_p * count)()
        self.outs = None  # the last call's output pointers, reused while the buffers stay


class LinearGroup:
    """Several `Linear`s of one input width applied to the same x (a layer's q, k and v; gate and up) as
    one kernel call per weight format among them (usually one; a GGUF's v may be Q6_K beside a Q4_K q
    and k): one wake of the thread pool, and int4 drafts round x to int8 once. `group(x, outs)` writes
    outs[i] = linears[i](x); each output is bitwise what its own call gives."""

    __slots__ = ("linears", "_calls")

    def __init__(self, linears: list[Linear]):
        if not 1 <= len(linears) <= 4:
            raise ValueError("a LinearGroup holds 1 to 4 linears")
        if len({lin.k for lin in linears}) != 1:
            raise ValueError("a LinearGroup's linears must share the input width")
        self.linears = list(linears)
        self._calls = []
        for fmt in dict.fromkeys(lin._format for lin in linears):
            index = [i for i, lin in enumerate(linears) if lin._format == fmt]
            self._calls.append(_GroupCall(index, [linears[i] for i in index]))

    def __call__(self, x: torch.Tensor, outs) -> tuple:
        for call in self._calls:
            pointers = tuple(outs[i].data_ptr() for i in call.index)
            if pointers != call.outs:
                call.outs = pointers
                call.out_ptrs[:] = pointers
            first = call.first
            kind = _FORMAT_CODES[first._format] if first._format != "int4" else _int4_code()
            if _library.rowwise_linear_group(x.data_ptr(), call.count, call.weights, call.scales, call.biases,
                                             call.out_ptrs, call.widths, x.shape[0], first.k, kind, _isa,
                                             torch.get_num_threads()):
                raise MemoryError("rowwise_linear_group: out of memory for its scratch buffer")
        return tuple(outs)


_FORMAT_CODES = {"f32": 0, "bf16": 1, "int8": 2, "q4k": 6, "q6k": 7, "panels": 8}


class _Product(ctypes.Structure):
    """C `layer_product`: one kernel call's matrices (a `LinearGroup` of one weight format)."""

    _fields_ = [("count", ctypes.c_int), ("weights", ctypes.c_int), ("K", ctypes.c_int64),
                ("w", ctypes.c_void_p * 4), ("s", ctypes.c_void_p * 4), ("b", ctypes.c_void_p * 4), ("N", ctypes.c_int64 * 4)]


class _LayerDesc(ctypes.Structure):
    """C `layer_desc`: a decoder layer's norms and its four products."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product)]


class LayerStack:
    """A decoder's layers run as one C call per small pass (`decoder_layers`): per layer RMSNorm, the q/k/v
    group, RoPE, cache write, `slot_attention`, o, RMSNorm, the gate/up group, SwiGLU and down, the very
    calls of a Python loop over `rms_norm`, `LinearGroup`, `rope_`, ... in the same order, so bitwise the
    same numbers, without their ~250 Python-to-C crossings per pass (~10% of a 4-bit 0.5B draft step).

    Built from one tuple per layer, (attn_norm, qkv: LinearGroup, o: Linear, mlp_norm, gate_up:
    LinearGroup, down: Linear); `LayerStack.build` returns None where a group mixes weight formats
    (a GGUF's Q6_K v beside Q4_K q and k), which only the Python loop runs."""

    __slots__ = ("_layers", "_descs", "_int4", "_int4_code", "_buffer_ptrs", "_buffers")

    _BUFFERS = ("normed", "delta", "q", "k", "v", "attended", "gate", "up")  # decoder_layers' buffer order

    def __init__(self, layers):
        self._layers = layers  # kept alive: the descriptors point into their tensors
        self._descs = (_LayerDesc * len(layers))()
        self._int4: list[_Product] = []  # products whose kernel code follows `_int4_code()` at call time
        for desc, (attn_norm, qkv, o, mlp_norm, gate_up, down) in zip(self._descs, layers):
            _check(attn_norm, mlp_norm)
            desc.attn_norm, desc.mlp_norm = attn_norm.data_ptr(), mlp_norm.data_ptr()
            for product, group in ((desc.qkv, qkv), (desc.o, LinearGroup([o])), (desc.gate_up, gate_up),
                                   (desc.down, LinearGroup([down]))):
                (call,) = group._calls
                product.count, product.K = call.count, call.first.k
                product.weights = _FORMAT_CODES.get(call.first._format, -1)
                if call.first._format == "int4":
                    self._int4.append(product)
                for i in range(call.count):
                    product.w[i], product.s[i], product.b[i], product.N[i] = (
                        call.weights[i], call.scales[i], call.biases[i], call.widths[i])
        self._int4_code = None
        self._buffers = None  # the last call's buffer pointers, reused while the buffers stay
        self._buffer_ptrs = (ctypes.c_void_p * len(self._BUFFERS))()

    @classmethod
    def build(cls, layers) -> "LayerStack | None":
        """A LayerStack, or None when some group needs more than one kernel call (mixed weight formats)."""
        if any(len(group._calls) != 1 for layer in layers for group in (layer[1], layer[4])):
            return None
        return cls(layers)

    def __call__(self, x: torch.Tensor, buffers: dict[str, torch.Tensor], batch: int, width: int, heads: int,
                 kv_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, start: int, scale: float, eps: float,
                 tree: torch.Tensor | None = None) -> None:
        """Run every layer on x [batch * width, hidden] (updated in place) with `buffers` (NativeCausalLM's
        names, each [batch * width, ...] contiguous float32); keys [layers, batch, kv_heads, capacity/16,
        head_dim, 16] and values [layers, batch, kv_heads, capacity, head_dim] of the store (each layer's
        block contiguous); positions long [batch * width]; visible, tree as `slot_attention` takes them.
        Afterwards buffers["delta"] holds the last layer's MLP output, not yet added to x."""
        _check(x, keys[0], values[0])
        code = _int4_code()
        if code != self._int4_code:
            for product in self._int4:
                product.weights = code
            self._int4_code = code
        pointers = tuple(buffers[name].data_ptr() for name in self._BUFFERS)
        if pointers != self._buffers:
            self._buffers = pointers
            self._buffer_ptrs[:] = pointers
        _check_masks(visible, tree, batch, width)
        status = _library.decoder_layers(
            self._descs, len(self._descs), x.data_ptr(), self._buffer_ptrs, batch, width, x.shape[1], heads, kv_heads,
            head_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), keys.stride(0),
            values.data_ptr(), values.stride(0), values.shape[3], visible.data_ptr(), visible.stride(0),
            None if tree is None else tree.data_ptr(), start, scale, eps, _isa, torch.get_num_threads())
        if status:
            raise MemoryError("decoder_layers: out of memory for a scratch buffer")


def _int4_code() -> int:
    """3: unpack nibbles to float; 4: int8 activations, AVX-512 VNNI; 5: int8 activations, AVX2 byte products."""
    if not _int8_activations:
        return 3
    return 4 if _isa == 512 and _vnni else 5


def rowwise_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> out [M, N], float32. Each output row depends on its input row only, bitwise.

    weight may be float32, bfloat16 (half the bytes), an `Int8Matrix` (a quarter) or an `Int4Matrix`
    (about a seventh): the narrower formats are converted exactly and accumulated in float32, but
    their rounded weights change the result: a draft-model option, not for a target. int4 matrices
    also round each activation row to int8 per group of 64 (unless VERISPEC_INT4_FLOAT is set).
    `ExactBlocks` (GGUF Q4_K / Q6_K) give bitwise the float32 matrix's result: fine for a target.
    """
    rows, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    _check(x, out)
    return Linear(weight, bias)(x, out)


def blocked_preferred() -> bool:
    """Whether big float32 passes (prefill) should multiply with `blocked_linear` rather than PyTorch's
    GEMM: on CPUs whose widest vectors are AVX2's, where PyTorch's MKL path measured 75-120 GFLOPS on
    2 Zen 3 cores against ~140 for `blocked_linear`. VERISPEC_TORCH_GEMM=1 keeps PyTorch's."""
    return isa() == 256 and not os.environ.get("VERISPEC_TORCH_GEMM")


def blocked_takes(weight) -> bool:
    """Whether `blocked_linear` multiplies this weight: a float32 matrix, a `PanelMatrix`, an `Int4Matrix`,
    or exact blocks (through their float32 matrix)."""
    return (isinstance(weight, (Int4Matrix, ExactBlocks, PanelMatrix))
            or (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32))


def blocked_linear(x: torch.Tensor, weights, biases=None) -> list[torch.Tensor]:
    """x [..., K] @ weights[i] [N_i, K].T (+ biases[i] [N_i]) -> [..., N_i] float32 for each of up to 4
    matrices sharing x, for many rows at once (a prompt's prefill): a blocked GEMM with packed register
    tiles, AVX2+FMA, x packed once for the group. A weight is float32, a `PanelMatrix` (read in place)
    or an `Int4Matrix` (widened to float32 panel by panel, no widened copy kept). Rows are independent
    (a row's numbers do not depend on the others or on how many there are) but differ from
    `rowwise_linear`'s in the last bits: another summation order."""
    count = len(weights)
    biases = [None] * count if biases is None else list(biases)
    if not 1 <= count <= 4 or len(biases) != count:
        raise ValueError("blocked_linear takes 1 to 4 matrices, and as many biases (or None)")
    k = x.shape[-1]
    for weight in weights:
        if not blocked_takes(weight) or weight.shape[1] != k:
            raise ValueError(f"weights must be float32 [N, {k}] matrices or Int4Matrix, got {weight.dtype} {tuple(weight.shape)}")
    weights = [w.dense if isinstance(w, ExactBlocks) else w for w in weights]
    rows = x.reshape(-1, k).contiguous()
    outs = [torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32) for weight in weights]
    codes = [w.values if isinstance(w, (Int4Matrix, PanelMatrix)) else w for w in weights]
    scales = [w.scale if isinstance(w, Int4Matrix) else None for w in weights]
    kinds = [1 if isinstance(w, Int4Matrix) else 2 if isinstance(w, PanelMatrix) else 0 for w in weights]
    _check(rows, *outs, *(t for t in (*biases, *scales) if t is not None))
    if any(not c.is_contiguous() or c.device.type != "cpu" for c in codes):
        raise ValueError("weights must be contiguous CPU matrices")
    if rows.shape[0] and k:
        packed = torch.empty(-(-rows.shape[0] // 6) * 6 * k, dtype=torch.float32)  # x in 6-row panels
        pointers = ctypes.c_void_p * count
        _library.blocked_linear_group(
            rows.data_ptr(), count, pointers(*(c.data_ptr() for c in codes)),
            pointers(*(None if t is None else t.data_ptr() for t in scales)),
            pointers(*(None if b is None else b.data_ptr() for b in biases)), pointers(*(o.data_ptr() for o in outs)),
            (ctypes.c_int64 * count)(*(w.shape[0] for w in weights)), (ctypes.c_int * count)(*kinds),
            rows.shape[0], k, packed.data_ptr(), torch.get_num_threads())
    elif rows.shape[0]:  # K = 0: the empty sum
        for out, bias in zip(outs, biases):
            out.copy_(torch.zeros_like(out) if bias is None else bias.expand_as(out))
    return outs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """out = RMSNorm(x) * weight per row of x [M, D]; with `residual` [M, D], first x += residual (in place)."""
    _check(x, weight, out, *(() if residual is None else (residual,)))
    _library.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                      out.data_ptr(), x.shape[0], x.shape[1], eps, _isa)
    return out


def rope_(x: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [M, heads * D] in place: row m by the angles of positions[m] (long [M]); cos/sin [P, D]."""
    _check(x, cos, sin)
    if positions.dtype != torch.long or not positions.is_contiguous():
        raise ValueError("positions must be a contiguous long tensor")
    _library.rope(x.data_ptr(), x.shape[0], x.shape[1], heads, cos.shape[1], positions.data_ptr(), cos.data_ptr(), sin.data_ptr())
    return x


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate <- silu(gate) * up, in place (the SwiGLU product of Shazeer 2020)."""
    _check(gate, up)
    _library.silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), _isa)
    return gate


def cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> None:
    """Store new keys/values [B, T, KVH, D] at slots start.. of k_cache [B, KVH, capacity/16, D, 16]
    (`SLOT_BLOCK`-slot blocks) and v_cache [B, KVH, capacity, D]."""
    _check(k, v, k_cache, v_cache)
    batch, width, kv_heads, head_dim = k.shape
    _library.cache_write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), batch, width, kv_heads,
                         head_dim, v_cache.shape[2], start)


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                   start: int, scale: float, out: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of T new tokens per row over the visible slots of a cache.

    q [B, T, H, D]; k_cache [B, KVH, capacity/16, D, 16] and v_cache [B, KVH, capacity, D], with the
    new tokens' keys/values already at slots start .. start+T-1; visible [B, >= start+T] bool (unit
    column stride). Query t of row b attends to slots s <= start+t with visible[b, s]; a query that
    sees nothing (padding) gets zeros. Returns out [B, T, H, D].

    tree [B, T, T] bool (a token tree: tree[b, t, j] when new token j is t or an ancestor of t, so
    j <= t): new slot start+j is then seen by query t only where tree[b, t, j]. A token's result is
    bitwise what it would be with only its own path in the cache.
    """
    batch, width, heads, head_dim = q.shape
    if head_dim % lanes():
        raise ValueError(f"head size {head_dim} is not a multiple of {lanes()}: use scaled_dot_product_attention")
    if out is None:
        out = torch.empty_like(q)
    _check(q, k_cache, v_cache, out)
    _check_masks(visible, tree, batch, width)
    status = _library.slot_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), visible.data_ptr(),
                                     None if tree is None else tree.data_ptr(), out.data_ptr(), batch, width, heads, k_cache.shape[1], head_dim,
                                     v_cache.shape[2], visible.stride(0), start, scale, _isa, torch.get_num_threads())
    if status:
        raise MemoryError("slot_attention could not allocate its score buffer")
    return out
