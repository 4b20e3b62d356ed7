/* The int8 vocabulary of the q8 kernels (kquant_q8.c, quant32_q8.c): vectors of VCOLS int32 lanes, one
 * output column each, and the dot steps on them, mapped per ISA. Included by a source compiled with
 * -DVS_Q8_512 (AVX-512 BW + VNNI: vpdpbusd) or -DVS_Q8_256 (AVX2: vpmaddubsw); see kernels/build.py. */
#ifndef VS_Q8_ISA_H
#define VS_Q8_ISA_H

#include "common.h"

#if defined(VS_Q8_512)
#define KQ(name) name##_512
#define VCOLS 16                  /* columns per vector: one int32 lane each */
typedef __m512i IVEC;
typedef __m512 FVEC;
#define ILOAD(p) _mm512_loadu_si512((const void *)(p))
#define IZERO _mm512_setzero_si512
#define ISET8 _mm512_set1_epi8
#define ISET32 _mm512_set1_epi32
#define IAND _mm512_and_si512
#define IOR _mm512_or_si512
#define ISRL16 _mm512_srli_epi16
#define ISLL16 _mm512_slli_epi16
#define IADD32 _mm512_add_epi32
#define ISUB16 _mm512_sub_epi16
#define HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))          /* 16 half floats */
#define U8X16(p) _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p)))      /* 32 bytes -> int16 */
#define I8X16(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define ICVT _mm512_cvtepi32_ps
#define FZERO _mm512_setzero_ps
#define FMUL _mm512_mul_ps
#define FADD _mm512_add_ps
#define FSUB _mm512_sub_ps
#define FSET1 _mm512_set1_ps
#define FLOAD _mm512_loadu_ps
#define FSTORE _mm512_storeu_ps
#elif defined(VS_Q8_256)
#define KQ(name) name##_256
#define VCOLS 8
typedef __m256i IVEC;
typedef __m256 FVEC;
#define ILOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define IZERO _mm256_setzero_si256
#define ISET8 _mm256_set1_epi8
#define ISET32 _mm256_set1_epi32
#define IAND _mm256_and_si256
#define IOR _mm256_or_si256
#define ISRL16 _mm256_srli_epi16
#define ISLL16 _mm256_slli_epi16
#define IADD32 _mm256_add_epi32
#define ISUB16 _mm256_sub_epi16
#define HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))             /* 8 half floats */
#define U8X16(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p)))         /* 16 bytes -> int16 */
#define I8X16(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define ICVT _mm256_cvtepi32_ps
#define FZERO _mm256_setzero_ps
#define FMUL _mm256_mul_ps
#define FADD _mm256_add_ps
#define FSUB _mm256_sub_ps
#define FSET1 _mm256_set1_ps
#define FLOAD _mm256_loadu_ps
#define FSTORE _mm256_storeu_ps
#else
#error "a q8 source: compile with -DVS_Q8_512 (AVX-512 BW + VNNI) or -DVS_Q8_256 (AVX2)"
#endif

#define VBYTES (4 * VCOLS)        /* bytes of a step (four weights of each column) in a vector */
#define PARTS (Q8G / VCOLS)       /* vectors across a group: 1 or 2 */
#define INLINE static inline __attribute__((always_inline))
#define Q8_AHEAD 4                /* blocks ahead the k-quant tiles prefetch the weights (see prefetch_block) */
#define Q32_AHEAD 12              /* the same for 32-weight blocks, whose groups are 8x smaller (see quant32_q8.c) */
#define Q8_RUN_BYTES 131072       /* weights of the column groups a wide pass takes together (see q8_groups) */

/* prefetch_block's lines, into L1 or (into_l2, a constant where it is called) L2 */
INLINE void prefetch_lines(const uint8_t *p, int64_t bytes, int step, int steps, int ahead, int into_l2)
{
    const int64_t lines = (bytes + 63) / 64, per = (lines + steps - 1) / steps;
    for (int64_t l = step * per; l < (step + 1) * per && l < lines; l++) {
        if (into_l2)
            _mm_prefetch((const char *)(p + ahead * bytes + 64 * l), _MM_HINT_T1);
        else
            _mm_prefetch((const char *)(p + ahead * bytes + 64 * l), _MM_HINT_T0);
    }
}

/* Prefetch part `step` of `steps` of the block group `bytes` at `ahead` groups after p. The blocks are one
 * sequential stream, but at 8 rows a tile spends long enough on each that the hardware prefetcher does not
 * run far enough ahead: without this a third of a wide tile's time stalled on its weight loads (perf,
 * Zen 5), with it the loads find the lines in cache. Past the matrix's end it reads nothing (a
 * prefetch never faults). */
INLINE void prefetch_block(const uint8_t *p, int64_t bytes, int step, int steps, int ahead)
{
    prefetch_lines(p, bytes, step, steps, ahead, 0);
}

/* Into L2 instead, `Q8_AHEAD_L2` groups ahead, for tiles of few rows (decode steps, short verify passes), which
 * spend little time on a group: there the stream is bound by how many lines are in flight, and L1's few fill
 * buffers cap what prefetches into L1 can have outstanding. At 8 rows and more the L1 prefetch above keeps ahead
 * better (bench/README, "Weights on huge pages"). */
#define Q8_AHEAD_L2 8
#define Q8_FEW_ROWS 4
/* A k-quant tile's prefetch for its rows R (a constant where the tile is instantiated) */
#define PREFETCH_TILE(blk, bytes, step, steps, R) \
    prefetch_lines(blk, bytes, step, steps, (R) <= Q8_FEW_ROWS ? Q8_AHEAD_L2 : Q8_AHEAD, (R) <= Q8_FEW_ROWS)

/* Four bytes at p as an int32 broadcast to every lane (a row's activations of one step, or a pair of int16). */
INLINE IVEC bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return ISET32(v);
}

#if VCOLS == 16
/* acc + w . (the four bytes at x, broadcast) as one vpdpbusd with an embedded broadcast: GCC leaves
 * _mm512_set1_epi32 of a load as a separate vpbroadcastd, which on Zen 5 cut the dot's throughput by a
 * quarter. w unsigned bytes, x signed. */
INLINE __m512i dpbusd_bcast(__m512i acc, __m512i w, const void *x)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

/* acc + pairwise w * (the int16 pair at p, broadcast), int16 -> int32: vpdpwssd, broadcast embedded */
INLINE __m512i dpwssd_bcast(__m512i acc, __m512i w, const void *p)
{
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}
#else
#define dpwssd_bcast(acc, w, p) _mm256_add_epi32(acc, _mm256_madd_epi16(w, bcast4(p)))
#endif

#if VCOLS == 16
/* The fifth bits of a vector's 64 weights (a 64-bit word at p, bit i for byte i) as 16 or 0 per byte. */
INLINE IVEC fifth_bits(const uint8_t *p, int part)
{
    (void)part;
    uint64_t bits;
    memcpy(&bits, p, 8);
    return _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), ISET8(16));
}
#else
/* The same for the 32 bytes of part `part`: bits 32 part .. 32 part + 31 of the word. */
INLINE IVEC fifth_bits(const uint8_t *p, int part)
{
    int32_t bits;
    memcpy(&bits, p + 4 * part, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(bits),  /* byte i <- byte i / 8 of the word */
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ull);  /* bit i % 8 of byte i */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), ISET8(16));
}
#endif

/* The bias of a column group's `cols` columns from n0 (zeros past them, or without a bias) into bias[Q8G]. */
INLINE void q8_bias(const q8_job *job, int64_t n0, int64_t cols, float *bias)
{
    memset(bias, 0, Q8G * sizeof(float));
    if (job->b) memcpy(bias, job->b + n0, (size_t)cols * sizeof(float));
}

/* One row's outputs of vector `part` of a column group (from y, the group's first column), out + b: a last group
 * narrower than Q8G (`cols` columns) stores only its own. */
INLINE void q8_store(float *y, FVEC out, FVEC b, int64_t cols, int part)
{
    y += VCOLS * part;
    if (cols == Q8G) {
        FSTORE(y, FADD(out, b));
        return;
    }
    float lanes[VCOLS];
    FSTORE(lanes, FADD(out, b));
    for (int c = 0; c < VCOLS && VCOLS * part + c < cols; c++) y[c] = lanes[c];
}

/* A tile: R activation rows (rows m0 ..) against one column group's blocks, vector `part` of the group's
 * columns, into out[0 .. R - 1]; tables of them are indexed by R (1 .. Q8TILE). */
typedef void (*q8_tile_fn)(const q8_job *, const uint8_t *, int64_t, int, FVEC *);

/* Column groups [begin, end) of a q8_job, each `size` bytes per block column and `blocks` blocks deep: every
 * row against each group's blocks, plus the bias; a last group narrower than Q8G stores only its columns. A pass
 * of up to `widest` rows is one tile (`tiles` has an entry for each count up to it), so each sub-block is decoded
 * once for all its rows: a verify pass of 9-16 rows as two tiles decoded the weights twice and cost 1.3-1.5x one
 * of 8 (the k-quants take 16: bench/README, "Weights on huge pages"). Wider passes go Q8TILE rows at a time (later
 * tiles re-read the group from cache). The loop of every block kind (kquant_q8.c, quant32_q8.c), which differ
 * only in their tiles. */
static inline void q8_groups(const q8_job *job, int64_t begin, int64_t end, const q8_tile_fn *tiles, int64_t blocks,
                             int64_t size, int widest)
{
    const int64_t N = job->N, span = blocks * size;
    /* Passes of more than one tile of rows (prefill) take the groups in runs of up to Q8_RUN_BYTES of weights, and
     * a run's groups for one tile of rows before the next tile: the tile's activations stay in L1, the run's weights
     * in L2, and each row's outputs go out as one stretch of the run's columns. Group by group with every tile of
     * rows wrote 16 columns of each row in turn, one cache line per row N floats apart (a new page each from N =
     * 1024 on): the 1.5B's 128-row gate/up (17920 columns) ran at 0.208 ns a vpdpbusd on two threads against 0.184
     * on 1024 columns, and 0.197 in runs (bench/q8_tile.c). In the pass (prefills of 128 and 400 tokens, one process,
     * arms rotated; bench/README): the q8 1.5B 0.94-0.96x the time, the 0.5B Q4_0 draft 0.80-0.99x; AVX2 the same
     * or better. Groups of a long K (down: 117 KB each) fit fewer than four to a run and go one at a time as before.
     * Which thread computes which output is unchanged, and so are the numbers. */
    const int64_t tile = job->M <= widest ? job->M : Q8TILE;
    const int64_t fit = Q8_RUN_BYTES / span, run = job->M <= tile || fit < 4 ? 1 : fit < 64 ? fit : 64;
    for (int64_t g0 = begin; g0 < end; g0 += run) {
        const int64_t g1 = g0 + run < end ? g0 + run : end;
        float bias[Q8G * 64];
        for (int64_t g = g0; g < g1; g++) {
            const int64_t n0 = g * Q8G;
            q8_bias(job, n0, N - n0 < Q8G ? N - n0 : Q8G, bias + Q8G * (g - g0));
        }
        for (int64_t m0 = 0; m0 < job->M; m0 += tile) {
            const int R = job->M - m0 < tile ? (int)(job->M - m0) : (int)tile;
            for (int64_t g = g0; g < g1; g++) {
                const uint8_t *group = job->w + g * span;
                const int64_t n0 = g * Q8G, cols = N - n0 < Q8G ? N - n0 : Q8G;
                for (int part = 0; part < PARTS; part++) {
                    FVEC out[Q8WIDE];
                    tiles[R](job, group, m0, part, out);
                    const FVEC b = FLOAD(bias + Q8G * (g - g0) + VCOLS * part);
                    for (int r = 0; r < R; r++) q8_store(job->y + (m0 + r) * N + n0, out[r], b, cols, part);
                }
            }
        }
    }
}

#endif
