/* ======== Q4_K and Q6_K blocks times Q8_K activations on AMX tiles: the prefill's wide passes, bitwise the VNNI kernel's ========
 * (compiled once, with -DVS_Q8_512 and the AMX flags; run only where kernels_amx found the tiles usable)
 *
 * kquant_q8.c multiplies a Q4_K sub-block of 32 weights by a row's activations in 8 vpdpbusd and scales that sum by
 * the sub-block's 6-bit scale sc: a wide pass is bound by one vpdpbusd port, 64 products a cycle. An AMX tile
 * product does 16 rows x 16 columns x 64 products in one instruction, but a scale that changes every 32 weights
 * would force the C tile out of the tiles eight times a block. So each scale is split, sc = 8 a + b (a, b in
 * 0..7), and folded into the weights while they are unpacked: two B tiles per 64 weights hold a * q and b * q
 * (q the 4-bit code; products at most 105, one vpmullw per 64 bytes, as two codes share a 16-bit lane
 * without carrying into each other). A block's 256 weights then leave two C tiles, Ta and Tb, and
 *     sumi = sum_j sc_j * sum_{32 of j} q * x = 8 * Ta + Tb
 * is the same integer as the VNNI kernel's (exact: |sumi| < 256 * 63 * 15 * 128 < 2^31). The mins' sum and the
 * float recipe per row and block (acc += (dy * d) * float(sumi), accm += (dy * dmin) * float(summ), out =
 * (acc - accm) + bias) are kquant_q8.c's operation for operation, so every output is bitwise the VNNI kernel's
 * at any width; tests/exactness/test_kernels_amx.py holds them to that.
 *
 * Q6_K's scales are signed bytes per 16 weights and its codes 6 bits (q - 32 in -32..31), so sc * (q - 32) does not
 * fit a byte either way. Each scale is written in three balanced base-8 digits, sc = 64 d2 + 8 d1 + d0 with every
 * digit in -3..4, and a digit times a code, at most 128 in size (4 * -32), is an exact byte: three B tiles per 64
 * weights, three C tiles per 16 rows, and sumi = 64 T2 + 8 T1 + T0 is kquant_q8.c's integer (|sumi| < 2^28).
 * Q6_K has no mins: acc += (dy * d) * float(sumi), out = acc + bias, as there.
 *
 * Order: a column group's blocks in turn; each block's weights are unpacked once into the B tiles (8 KB, Q6_K 12 KB)
 * and serve every row (Q4_K two slabs of 16 at a time, q8_at: an A tile each; Q6_K one), the float sums of every
 * row kept in memory between blocks. Rows never meet: a row's outputs are the same operations on its own
 * activations whatever M. */
#include "common.h"
#include "kernels.h"

#include "q8_isa.h"

/* AMX tile registers (ldtilecfg's palette 1): C tiles 16 rows x 16 int32 (Ta, Tb of two slabs of 16 rows), A tiles
 * a slab's 16 activation rows x 64 bytes, B tiles 16 steps x (16 columns x 4 weights). The 2 x 2 blocking (two A
 * tiles meet two B tiles) fills the eight registers; the tiles are not renamed, so fewer, wider products leave the
 * multiplier less time waiting on loads into registers that earlier products still read. */
#define TA_0 0   /* Ta of rows m0 .. m0 + 15 */
#define TB_0 1
#define TA_1 2   /* ... of rows m0 + 16 .. m0 + 31 */
#define TB_1 3
#define A_0 4
#define A_1 5
#define B_A 6    /* codes times a_j */
#define B_B 7    /* codes times b_j */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The shapes of tiles 0 .. count - 1, every row 64 bytes: C and A tiles (below first_b) a slab's rows, fewer in a
 * pass narrower than one; B tiles 16 steps. Loaded at every call: they are per thread, and another user of the tiles
 * on this thread (oneDNN's bfloat16 GEMMs under PyTorch) may have set others since; a call puts back what it found. */
static tile_config tiles_for(int rows, int first_b, int count)
{
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < count; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= first_b ? 16 : rows;
    }
    return cfg;
}

/* The rows' float sums, two sets (acc, accm) of 16 per row for M16 rows: a thread's buffer, kept between calls (the
 * pool hands a thread one or two column groups at a time). NULL when memory ran out. */
static float *row_sums(int64_t M16)
{
    static __thread float *sums;
    static __thread int64_t held;
    if (held < M16) {
        free(sums);
        held = 0;
        sums = aligned_alloc(64, (size_t)(2 * M16 * Q8G) * sizeof(float));
        if (!sums) return NULL;
        held = M16;
    }
    return sums;
}

/* Block `blk` of a repacked group (kquant_q8_pack.c) -> the B tiles of its four 64-weight chunks: step s (weights
 * 4 s .. 4 s + 3 of each column) of sub-block j = s / 8 at row s of ba (codes times a_j) and bb (times b_j). */
static void unpack_block(const uint8_t *blk, uint8_t *ba, uint8_t *bb)
{
    const __m512i low4 = _mm512_set1_epi8(15), seven = _mm512_set1_epi32(7);
    for (int j = 0; j < 8; j++) {
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 + 16 * j)));
        const __m512i a = _mm512_srli_epi32(sc, 3), b = _mm512_and_si512(sc, seven);
        const __m512i a16 = _mm512_or_si512(a, _mm512_slli_epi32(a, 16)), b16 = _mm512_or_si512(b, _mm512_slli_epi32(b, 16));
        for (int u = 0; u < 4; u++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(blk + 320 + 64 * (4 * j + u)));
            const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            const int s_lo = 8 * j + u, s_hi = 8 * j + 4 + u;  /* chunk 4 j + u: steps 8 j + u and 8 j + 4 + u */
            _mm512_store_si512((void *)(ba + 64 * s_lo), _mm512_mullo_epi16(lo, a16));
            _mm512_store_si512((void *)(bb + 64 * s_lo), _mm512_mullo_epi16(lo, b16));
            _mm512_store_si512((void *)(ba + 64 * s_hi), _mm512_mullo_epi16(hi, a16));
            _mm512_store_si512((void *)(bb + 64 * s_hi), _mm512_mullo_epi16(hi, b16));
        }
    }
}

/* A block's C tiles for rows m0 .. m0 + 31, stored, waiting to be folded into the rows' float sums. */
typedef struct {
    int64_t m0, b;
    __m512 d, dmin;       /* the block's scales, 16 columns */
    __m512i mins[4];      /* its mins as int16 pairs (kquant_q8_pack.c) */
    int32_t (*c)[Q8SLAB][16];  /* Ta, Tb of the first slab, then of the second */
} stored_tiles;

/* The float recipe of kquant_q8.c's q4k_tile for the rows of `t`: sumi = 8 Ta + Tb, summ the mins against the
 * rows' sums of 32 codes, acc += (dy * d) * float(sumi), accm += (dy * dmin) * float(summ). */
INLINE void settle(const q8_job *job, const stored_tiles *t, float *acc, float *accm, int64_t blocks)
{
    const int64_t left = job->M - t->m0, rows = left < 2 * Q8SLAB ? left : 2 * Q8SLAB;
    const int first = t->b == 0;  /* the sums start here: 0 + the first block's, as kquant_q8.c's from zero */
    const __m512 zero = _mm512_setzero_ps();
    for (int slab = 0; slab * Q8SLAB < rows; slab++) {
        const int64_t at = q8_at(t->m0 + slab * Q8SLAB, t->b, blocks), m = t->m0 + slab * Q8SLAB;
        const int n = rows - slab * Q8SLAB < Q8SLAB ? (int)(rows - slab * Q8SLAB) : Q8SLAB;
        for (int i = 0; i < n; i++) {
            const __m512i sumi = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(t->c[2 * slab][i]), 3),
                                                  _mm512_load_si512(t->c[2 * slab + 1][i]));
            __m512i summ = _mm512_setzero_si512();
            for (int l = 0; l < 4; l++) summ = dpwssd_bcast(summ, t->mins[l], job->qb32 + (at + i) * 8 + 2 * l);
            const __m512 dy = _mm512_set1_ps(job->qd[at + i]);
            float *a = acc + (m + i) * Q8G, *am = accm + (m + i) * Q8G;
            _mm512_store_ps(a, _mm512_add_ps(first ? zero : _mm512_load_ps(a), _mm512_mul_ps(_mm512_mul_ps(dy, t->d), _mm512_cvtepi32_ps(sumi))));
            _mm512_store_ps(am, _mm512_add_ps(first ? zero : _mm512_load_ps(am), _mm512_mul_ps(_mm512_mul_ps(dy, t->dmin), _mm512_cvtepi32_ps(summ))));
        }
    }
}

/* Column groups [begin, end) of a Q4_K q8_job: what q8_range gives, through the tiles. 0, or -1 when scratch
 * memory ran out (nothing written then). Software-pipelined: the vector units settle one 32-row product while
 * the tile unit runs the next (the tiles' instructions are only issued in order among themselves). */
static int q4k_amx_range(const q8_job *job, int64_t begin, int64_t end)
{
    const int64_t K = job->K, blocks = K / QK_K, N = job->N, M = job->M, M16 = q8_rows(M);
    float *sums = row_sums(M16);
    if (!sums) return -1;
    float *acc = sums, *accm = sums + M16 * Q8G;
    uint8_t ba[64 * 64] __attribute__((aligned(64))), bb[64 * 64] __attribute__((aligned(64)));
    int32_t c[2][4][Q8SLAB][16] __attribute__((aligned(64)));  /* two products' C tiles: one settling, one stored */
    tile_config found;
    _tile_storeconfig(&found);  /* all zero where this thread has no tiles configured */
    const tile_config mine = tiles_for(M < Q8SLAB ? (int)M : Q8SLAB, B_A, B_B + 1);
    _tile_loadconfig(&mine);
    for (int64_t g = begin; g < end; g++) {
        const uint8_t *group = job->w + g * blocks * Q4G_BYTES;
        stored_tiles waiting = {0};
        int have = 0, buffer = 0;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *blk = group + b * Q4G_BYTES;
            for (int step = 0; step < 8; step++) prefetch_block(blk, Q4G_BYTES, step, 8, Q8_AHEAD);
            unpack_block(blk, ba, bb);
            const __m512 d = HALVES(blk), dmin = HALVES(blk + 32);
            for (int64_t m0 = 0; m0 < M; m0 += 2 * Q8SLAB) {
                const int two = m0 + Q8SLAB < M;  /* rows past m0 + 16: the second slab */
                const int8_t *x0 = job->qx + q8_at(m0, b, blocks) * QK_K;
                const int8_t *x1 = two ? job->qx + q8_at(m0 + Q8SLAB, b, blocks) * QK_K : 0;
                _tile_zero(TA_0);
                _tile_zero(TB_0);
                if (two) {
                    _tile_zero(TA_1);
                    _tile_zero(TB_1);
                }
                for (int k = 0; k < 4; k++) {  /* 64 weights: sub-blocks 2 k, 2 k + 1 */
                    _tile_loadd(A_0, x0 + 64 * k, QK_K);
                    _tile_loadd(B_A, ba + 1024 * k, 64);
                    _tile_loadd(B_B, bb + 1024 * k, 64);
                    _tile_dpbssd(TA_0, A_0, B_A);
                    _tile_dpbssd(TB_0, A_0, B_B);
                    if (two) {
                        _tile_loadd(A_1, x1 + 64 * k, QK_K);
                        _tile_dpbssd(TA_1, A_1, B_A);
                        _tile_dpbssd(TB_1, A_1, B_B);
                    }
                }
                if (have) settle(job, &waiting, acc, accm, blocks);  /* the previous product, meanwhile */
                int32_t (*out)[Q8SLAB][16] = c[buffer];
                _tile_stored(TA_0, out[0], 64);
                _tile_stored(TB_0, out[1], 64);
                if (two) {
                    _tile_stored(TA_1, out[2], 64);
                    _tile_stored(TB_1, out[3], 64);
                }
                waiting = (stored_tiles){.m0 = m0, .b = b, .d = d, .dmin = dmin, .c = out};
                for (int l = 0; l < 4; l++) waiting.mins[l] = U8X16(blk + 192 + 32 * l);
                have = 1;
                buffer ^= 1;
            }
        }
        if (have) settle(job, &waiting, acc, accm, blocks);
        const int64_t n0 = g * Q8G, cols = N - n0 < Q8G ? N - n0 : Q8G;
        float bias[Q8G];
        q8_bias(job, n0, cols, bias);
        const __m512 bv = _mm512_loadu_ps(bias);
        for (int64_t m = 0; m < M; m++)
            q8_store(job->y + m * N + n0, _mm512_sub_ps(_mm512_load_ps(acc + m * Q8G), _mm512_load_ps(accm + m * Q8G)), bv, cols, 0);
    }
    /* Another user's shapes go back as they were, for one that trusts its own record of them; else the tiles stay
     * configured (released, the next call would set up their state anew). */
    if (found.palette && memcmp(&found, &mine, sizeof mine)) _tile_loadconfig(&found);
    return 0;
}

/* ---- Q6_K ---- */

/* Tile registers of the Q6_K product: the three digits' C tiles of one slab, its A tile, the three digits' B tiles
 * (the tile intrinsics take literal register numbers). */
#define T6_0 0
#define T6_1 1
#define T6_2 2
#define A6 3
#define B6_0 4
#define B6_1 5
#define B6_2 6

/* d * v for 64 bytes v and, per 32-bit lane (a column), an int16 digit d in both halves: exact where the product fits a
 * byte. vpmullw keeps the low 16 bits of each lane's product, so the even bytes, multiplied alone, keep their product
 * mod 256 in the low byte, and the odd ones, shifted up, in the high byte. */
INLINE __m512i times_digit(__m512i even, __m512i odd, __m512i d16)
{
    return _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, _mm512_mullo_epi16(even, d16), _mm512_mullo_epi16(odd, d16));
}

/* One lane's int32 digit as the int16 pair vpmullw takes. */
INLINE __m512i digit16(__m512i d)
{
    return _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(d, 16));
}

/* Block `blk` of a repacked Q6_K group -> the B tiles of its four 64-weight chunks: step s (weights 4 s .. 4 s + 3
 * of each column, s / 4 its sub-block g) at row s of bt[t], as digit t of column c's scale of g times (q - 32). */
static void unpack_q6k(const uint8_t *blk, uint8_t *bt0, uint8_t *bt1, uint8_t *bt2)
{
    const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
    const __m512i three = _mm512_set1_epi32(3), seven = _mm512_set1_epi32(7), lows = _mm512_set1_epi16(0xFF);
    for (int g = 0; g < 16; g++) {
        const __m512i pairs = I8X16(blk + 32 + 32 * (g / 2));  /* column c's sc[2 l], sc[2 l + 1] as an int16 pair */
        const __m512i sc = g % 2 ? _mm512_srai_epi32(pairs, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16);
        const __m512i d0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(sc, three), seven), three);
        const __m512i s1 = _mm512_srai_epi32(_mm512_sub_epi32(sc, d0), 3);
        const __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(s1, three), seven), three);
        const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(s1, d1), 3);
        const __m512i D0 = digit16(d0), D1 = digit16(d1), D2 = digit16(d2);
        const __m512i lo0 = _mm512_loadu_si512((const void *)(blk + 288 + 64 * (2 * g)));
        const __m512i lo1 = _mm512_loadu_si512((const void *)(blk + 288 + 64 * (2 * g + 1)));
        const __m512i hi = _mm512_loadu_si512((const void *)(blk + 2336 + 64 * g));
        const __m512i w[4] = {  /* kquant_q8.c's q6k_tile: steps 4 g .. 4 g + 3, codes 0..63 */
            _mm512_or_si512(_mm512_and_si512(lo0, low4), _mm512_and_si512(_mm512_slli_epi16(hi, 4), top2)),
            _mm512_or_si512(_mm512_and_si512(lo1, low4), _mm512_and_si512(_mm512_slli_epi16(hi, 2), top2)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo0, 4), low4), _mm512_and_si512(hi, top2)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo1, 4), low4), _mm512_and_si512(_mm512_srli_epi16(hi, 2), top2))};
        for (int v = 0; v < 4; v++) {
            const __m512i x = _mm512_sub_epi8(w[v], off);
            const __m512i even = _mm512_and_si512(x, lows), odd = _mm512_andnot_si512(lows, x);
            const int64_t row = 64 * (4 * g + v);
            _mm512_store_si512((void *)(bt0 + row), times_digit(even, odd, D0));
            _mm512_store_si512((void *)(bt1 + row), times_digit(even, odd, D1));
            _mm512_store_si512((void *)(bt2 + row), times_digit(even, odd, D2));
        }
    }
}

/* kquant_q8.c's q6k_tile float step for the rows of one slab's stored C tiles: acc += (dy * d) * float(sumi). */
INLINE void settle_q6k(const q8_job *job, int64_t m0, int64_t b, __m512 d, int32_t (*c)[Q8SLAB][16], float *acc,
                       int64_t blocks)
{
    const int n = job->M - m0 < Q8SLAB ? (int)(job->M - m0) : Q8SLAB;
    const int64_t at = q8_at(m0, b, blocks);
    for (int i = 0; i < n; i++) {
        const __m512i sumi = _mm512_add_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[2][i]), 6), _mm512_slli_epi32(_mm512_load_si512(c[1][i]), 3)),
            _mm512_load_si512(c[0][i]));
        const __m512 dy = _mm512_set1_ps(job->qd[at + i]);
        float *a = acc + (m0 + i) * Q8G;
        _mm512_store_ps(a, _mm512_add_ps(b ? _mm512_load_ps(a) : _mm512_setzero_ps(),  /* from zero, as Q4_K's */
                                         _mm512_mul_ps(_mm512_mul_ps(dy, d), _mm512_cvtepi32_ps(sumi))));
    }
}

/* Column groups [begin, end) of a Q6_K q8_job, as q4k_amx_range: one slab of 16 rows a product, settled while the
 * tile unit runs the next. */
static int q6k_amx_range(const q8_job *job, int64_t begin, int64_t end)
{
    const int64_t K = job->K, blocks = K / QK_K, N = job->N, M = job->M, M16 = q8_rows(M);
    float *acc = row_sums(M16);
    if (!acc) return -1;
    uint8_t bt[3][64 * 64] __attribute__((aligned(64)));
    int32_t c[2][3][Q8SLAB][16] __attribute__((aligned(64)));
    tile_config found;
    _tile_storeconfig(&found);
    const tile_config mine = tiles_for(M < Q8SLAB ? (int)M : Q8SLAB, B6_0, B6_2 + 1);
    _tile_loadconfig(&mine);
    for (int64_t g = begin; g < end; g++) {
        const uint8_t *group = job->w + g * blocks * Q6G_BYTES;
        int64_t wait_m0 = 0, wait_b = 0;
        __m512 wait_d = _mm512_setzero_ps();
        int have = 0, buffer = 0;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *blk = group + b * Q6G_BYTES;
            for (int step = 0; step < 8; step++) prefetch_block(blk, Q6G_BYTES, step, 8, Q8_AHEAD);
            unpack_q6k(blk, bt[0], bt[1], bt[2]);
            const __m512 d = HALVES(blk);
            for (int64_t m0 = 0; m0 < M; m0 += Q8SLAB) {
                const int8_t *x = job->qx + q8_at(m0, b, blocks) * QK_K;
                _tile_zero(T6_0);
                _tile_zero(T6_1);
                _tile_zero(T6_2);
                for (int k = 0; k < 4; k++) {  /* 64 weights: sub-blocks 4 k .. 4 k + 3 */
                    _tile_loadd(A6, x + 64 * k, QK_K);
                    _tile_loadd(B6_0, bt[0] + 1024 * k, 64);
                    _tile_loadd(B6_1, bt[1] + 1024 * k, 64);
                    _tile_loadd(B6_2, bt[2] + 1024 * k, 64);
                    _tile_dpbssd(T6_0, A6, B6_0);
                    _tile_dpbssd(T6_1, A6, B6_1);
                    _tile_dpbssd(T6_2, A6, B6_2);
                }
                if (have) settle_q6k(job, wait_m0, wait_b, wait_d, c[buffer ^ 1], acc, blocks);
                _tile_stored(T6_0, c[buffer][0], 64);
                _tile_stored(T6_1, c[buffer][1], 64);
                _tile_stored(T6_2, c[buffer][2], 64);
                wait_m0 = m0, wait_b = b, wait_d = d, have = 1;
                buffer ^= 1;
            }
        }
        if (have) settle_q6k(job, wait_m0, wait_b, wait_d, c[buffer ^ 1], acc, blocks);
        const int64_t n0 = g * Q8G, cols = N - n0 < Q8G ? N - n0 : Q8G;
        float bias[Q8G];
        q8_bias(job, n0, cols, bias);
        const __m512 bv = _mm512_loadu_ps(bias);
        for (int64_t m = 0; m < M; m++) q8_store(job->y + m * N + n0, _mm512_load_ps(acc + m * Q8G), bv, cols, 0);
    }
    if (found.palette && memcmp(&found, &mine, sizeof mine)) _tile_loadconfig(&found);
    return 0;
}

int q8_amx_range(const q8_job *job, int64_t begin, int64_t end)
{
    return job->kind == GGML_Q4_K ? q4k_amx_range(job, begin, end)
         : job->kind == GGML_Q6_K ? q6k_amx_range(job, begin, end) : -1;
}
