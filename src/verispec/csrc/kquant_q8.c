/* ======== GGUF k-quant blocks times activations rounded as ggml's Q8_K: llama.cpp's numerics ========
 * (compiled twice: -DVS_Q8_512 with AVX-512 BW + VNNI, -DVS_Q8_256 with AVX2; see kernels/build.py)
 *
 * llama.cpp's numerics for a Q4_K / Q5_K / Q6_K matrix (Q5_K: Q4_K's recipe on 5-bit codes): each activation row is rounded to 8 bits per block
 * of 256 (ggml's quantize_row_q8_K_ref: amax over the block, the value of largest magnitude `max`,
 * iscale = -127 / max, q = min(127, nearest_int(iscale * x)), d = 1 / iscale, and the sums of q per
 * 16), and each block's dot product is integer arithmetic on the file's codes:
 *   Q4_K: sumi = sum_j sc[j] * sum_{32 of sub-block j} q4 * q8,  summ = sum_j m[j] * (bsums of sub-block j)
 *   Q6_K: sumi = sum_g sc[g] * sum_{16 of group g} (q6 - 32) * q8
 * (dy the row's Q8_K scale of the block, d and dmin the block's half-precision scales). The integers
 * are exact (any order gives them), so they are ggml's to the bit. The float part, per output y[m, n],
 * with float32 rounding after every operation and no fused multiply-add, over the blocks b in order:
 *   Q4_K: acc += (dy * d) * float(sumi);  accm += (dy * dmin) * float(summ);  y = (acc - accm) + bias
 *   Q6_K: acc += (dy * d) * float(sumi);  y = acc + bias
 * (acc, accm starting at 0). ggml sums its lanes otherwise and fuses, so a result is within float32
 * rounding of llama.cpp's, not bitwise; both ISAs here give the same bits.
 *
 * How: the blocks are repacked at load (kquant_q8_pack.c) so one int32 lane is one output column:
 * a vector holds 16 columns' (AVX2: 8 columns') next four weights, and a row's four activation bytes,
 * broadcast, meet them in one vpdpbusd (AVX2: vpmaddubsw, sums of eight steps in int16, then vpmaddwd
 * by the sub-block's scales). A sub-block's weights are decoded once into registers and serve every
 * row of the tile; scales, mins and the float work are one vector op per 16 (8) columns and row.
 *
 * Row independence: every output y[m, n] is that sequence of operations on row m's own Q8_K blocks
 * and column n's blocks, whatever M and however threads split the columns (they split groups of 16
 * columns only). Rows run in tiles sharing each decoded sub-block (a pass of up to Q8WIDE rows, a verify pass's, in one
 * tile; a wider one, a prefill's, in tiles of Q8TILE); rows never meet. */
#include "common.h"
#include "kernels.h"

#include "q8_isa.h"

/* ggml's nearest_int: round to nearest, ties to even, for |f| < 2^22 (here |f| <= 127) */
static inline int nearest_int(float f)
{
    const float shifted = f + 12582912.f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    return (bits & 0x007fffff) - 0x00400000;
}

/* One block of 256 to Q8_K by ggml's reference (quantize_row_q8_K_ref), operation for operation:
 * q [256], d, and the codes' sums per 16 (bs). */
static void q8k_block_reference(const float *v, int8_t *q, float *d, int16_t *bs)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK_K; j++) {
        const float a = fabsf(v[j]);
        if (a > amax) { amax = a; max = v[j]; }
    }
    if (amax == 0.0f) {
        *d = 0.0f;
        memset(q, 0, QK_K);
    } else {
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; j++) {
            const int r = nearest_int(iscale * v[j]);
            q[j] = (int8_t)(r < 127 ? r : 127);
        }
        *d = 1.0f / iscale;
    }
    for (int g = 0; g < QK_K / 16; g++) {
        int sum = 0;
        for (int j = 0; j < 16; j++) sum += q[g * 16 + j];
        bs[g] = (int16_t)sum;
    }
}

/* The same block in AVX2, bitwise the reference's: the peak is the first element of the largest
 * magnitude (the reference's strict >), iscale * v rounded to nearest even by vcvtps2dq as by
 * nearest_int. A block holding a NaN or an infinity goes to the reference (whatever it makes of them). */
static void q8k_block(const float *v, int8_t *q, float *d, int16_t *bs)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 peak = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int j = 0; j < QK_K; j += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j));
        peak = _mm256_max_ps(peak, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  /* NaN or infinite */
    }
    if (_mm256_movemask_ps(bad)) {
        q8k_block_reference(v, q, d, bs);
        return;
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    if (amax == 0.0f) {
        *d = 0.0f;
        memset(q, 0, QK_K);
        memset(bs, 0, QK_K / 16 * sizeof(int16_t));
        return;
    }
    int first = 0;
    for (int j = 0; j < QK_K; j += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)),
                                                          _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (hits) { first = j + __builtin_ctz((unsigned)hits); break; }
    }
    const float iscale = -127.f / v[first];
    const __m256 scale = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int j = 0; j < QK_K; j += 32) {
        __m256i r[4];
        for (int i = 0; i < 4; i++)
            r[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(v + j + 8 * i))), top);
        /* int32 -> int8 (all within [-127, 127]): the packs interleave 128-bit lanes, the permute restores order */
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])), order);
        _mm256_storeu_si256((__m256i *)(q + j), bytes);
        /* sums of 8 codes + 8 * 128 (biased to unsigned for vpsadbw), two per 16 */
        const __m256i sums = _mm256_sad_epu8(_mm256_xor_si256(bytes, flip), _mm256_setzero_si256());
        bs[j / 16] = (int16_t)(_mm256_extract_epi64(sums, 0) + _mm256_extract_epi64(sums, 1) - 2048);
        bs[j / 16 + 1] = (int16_t)(_mm256_extract_epi64(sums, 2) + _mm256_extract_epi64(sums, 3) - 2048);
    }
    *d = 1.0f / iscale;
}

/* Rows of x [M, K] to Q8_K: the codes qx (int8), the scales d qd, the sums of 16 codes qb and of 32 qb32 (both
 * int16), in slabs of Q8SLAB rows (see q8_job). Bitwise ggml's quantize_row_q8_K_ref. */
void KQ(q8k_quantize)(const float *x, int8_t *qx, float *qd, int16_t *qb, int16_t *qb32, int64_t M, int64_t K)
{
    const int64_t blocks = K / QK_K;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i = q8_at(m, b, blocks);
            int16_t *bs = qb + i * (QK_K / 16);
            q8k_block(x + m * K + b * QK_K, qx + i * QK_K, qd + i, bs);
            for (int g = 0; g < QK_K / 32; g++) qb32[i * (QK_K / 32) + g] = (int16_t)(bs[2 * g] + bs[2 * g + 1]);
        }
}


/* ---- Q4_K: a sub-block of 32 weights is 8 steps; its scale multiplies each column's int32 sum ---- */

/* The sub-block's scales as the multiplier the dot step wants: int32 per column (VNNI), or per column
 * the scale in both int16 halves of its lane (AVX2: vpmaddwd against int16 pair sums). */
INLINE IVEC q4k_scales(const uint8_t *p)
{
#if VCOLS == 16
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
#endif
}

/* One step of a sub-block's dot product for one row: t + w . (the row's four activations at x, broadcast),
 * and the sub-block's end: sumi + scale * t. VNNI: int32 t, one vpdpbusd a step, the scale an int32
 * multiply. AVX2: int16 t (vpmaddubsw pair sums; Q4_K's eight steps stay within int16, 8 * 2 * 15 * 127,
 * Q6_K's two, 2 * 2 * 63 * 127), the scale applied by vpmaddwd. */
#if VCOLS == 16
#define DOT_STEP(t, w, x) dpbusd_bcast(t, w, x)
#define DOT_END(sumi, t, scale) _mm512_add_epi32(sumi, _mm512_mullo_epi32(t, scale))
#define Q6_SPAN 4                 /* steps a Q6_K t may hold */
#else
#define DOT_STEP(t, w, x) _mm256_add_epi16(t, _mm256_maddubs_epi16(w, bcast4(x)))
#define DOT_END(sumi, t, scale) _mm256_add_epi32(sumi, _mm256_madd_epi16(t, scale))
#define Q6_SPAN 2
#endif


/* Part `part` (VCOLS columns) of a group's Q4_K blocks (five: Q5_K's, codes 0..31) against rows
 * m0 .. m0 + R - 1: out[r] = acc - accm. Q5_K is Q4_K with a fifth bit per weight and the same scales,
 * mins and float recipe (ggml's vec_dot_q5_K_q8_K). */
INLINE void q4k_tile(const q8_job *job, const uint8_t *group, int64_t m0, const int R, int part, FVEC *out, const int five)
{
    const int64_t K = job->K, blocks = K / QK_K, size = five ? Q5G_BYTES : Q4G_BYTES;
    const IVEC low4 = ISET8(15);
    FVEC acc[Q8WIDE], accm[Q8WIDE];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = FZERO();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = group + b * size;
        const int64_t at0 = q8_at(m0, b, blocks);  /* row m0 + r's block b: at0 + r (m0 starts a tile) */
        const int8_t *x = job->qx + at0 * QK_K;
        IVEC sumi[Q8WIDE];
        for (int r = 0; r < R; r++) sumi[r] = IZERO();
        for (int j = 0; j < 8; j++) {
            if (part == 0) PREFETCH_TILE(blk, size, j, 8, R);
            const uint8_t *qs = blk + 320 + 4 * 64 * j + VBYTES * part;
            IVEC w[8];
            for (int u = 0; u < 4; u++) {
                const IVEC raw = ILOAD(qs + 64 * u);
                w[u] = IAND(raw, low4);
                w[4 + u] = IAND(ISRL16(raw, 4), low4);
                if (five) {
                    const uint8_t *bits = blk + Q4G_BYTES + 16 * (4 * j + u);
                    w[u] = IOR(w[u], fifth_bits(bits, part));
                    w[4 + u] = IOR(w[4 + u], fifth_bits(bits + 8, part));
                }
            }
            const IVEC scale = q4k_scales(blk + 64 + 16 * j + VCOLS * part);
#if VCOLS == 16
            /* step-major over the tile's rows: R independent chains in flight, not one at a time */
            IVEC t[Q8WIDE];
            for (int r = 0; r < R; r++) t[r] = IZERO();
            for (int u = 0; u < 8; u++) {  /* step 8 j + u: weights 32 j + 4 u (u < 4), 32 j + 16 + 4 (u - 4) */
                const int64_t at = 32 * j + (u < 4 ? 4 * u : 16 + 4 * (u - 4));
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) t[r] = DOT_STEP(t[r], w[u], x + r * QK_K + at);
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) sumi[r] = DOT_END(sumi[r], t[r], scale);
#else
            /* row by row: AVX2's 16 registers cannot hold a t per row beside w[8] and sumi. t sums pairs in
             * int16: eight Q4_K steps fit (8 * 2 * 15 * 127), Q5_K's fit four at a time (4 * 2 * 31 * 127) */
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                if (five) {
                    for (int half = 0; half < 2; half++) {
                        IVEC t = IZERO();
                        for (int u = 4 * half; u < 4 * half + 4; u++)
                            t = DOT_STEP(t, w[u], x + r * QK_K + 32 * j + (u < 4 ? 4 * u : 16 + 4 * (u - 4)));
                        sumi[r] = DOT_END(sumi[r], t, scale);
                    }
                } else {
                    IVEC t = IZERO();
                    for (int u = 0; u < 8; u++) t = DOT_STEP(t, w[u], x + r * QK_K + 32 * j + (u < 4 ? 4 * u : 16 + 4 * (u - 4)));
                    sumi[r] = DOT_END(sumi[r], t, scale);
                }
            }
#endif
        }
        const FVEC d = HALVES(blk + 2 * VCOLS * part), dmin = HALVES(blk + 32 + 2 * VCOLS * part);
        IVEC mins[4];
        for (int l = 0; l < 4; l++) mins[l] = U8X16(blk + 192 + 32 * l + 2 * VCOLS * part);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const int64_t row = at0 + r;
            IVEC summ = IZERO();
            for (int l = 0; l < 4; l++) summ = dpwssd_bcast(summ, mins[l], job->qb32 + row * 8 + 2 * l);
            const FVEC dy = FSET1(job->qd[row]);
            acc[r] = FADD(acc[r], FMUL(FMUL(dy, d), ICVT(sumi[r])));
            accm[r] = FADD(accm[r], FMUL(FMUL(dy, dmin), ICVT(summ)));
        }
    }
    for (int r = 0; r < R; r++) out[r] = FSUB(acc[r], accm[r]);
}

/* ---- Q6_K: a sub-block of 16 weights is 4 steps; codes unsigned (q + 32), the 32 taken off with bsums ---- */

/* Sub-block 2 l + odd's scales from the pair words of l (column c's int16 sc[2 l], sc[2 l + 1]). */
INLINE IVEC q6k_scales(IVEC pairs, int odd)
{
#if VCOLS == 16
    return odd ? _mm512_srai_epi32(pairs, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16);
#else
    return odd ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xF5), 0xF5)   /* words 1, 1, 3, 3 */
               : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xA0), 0xA0);  /* words 0, 0, 2, 2 */
#endif
}

INLINE void q6k_tile(const q8_job *job, const uint8_t *group, int64_t m0, const int R, int part, FVEC *out)
{
    const int64_t K = job->K, blocks = K / QK_K;
    const IVEC low4 = ISET8(15), top2 = ISET8(0x30);
    FVEC acc[Q8WIDE];
    for (int r = 0; r < R; r++) acc[r] = FZERO();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = group + b * Q6G_BYTES;
        const int64_t at0 = q8_at(m0, b, blocks);  /* as in q4k_tile */
        const int8_t *x = job->qx + at0 * QK_K;
        IVEC sumi[Q8WIDE];
        for (int r = 0; r < R; r++) sumi[r] = IZERO();
        for (int l = 0; l < 8; l++) {
            if (part == 0) PREFETCH_TILE(blk, Q6G_BYTES, l, 8, R);
            const IVEC pairs = I8X16(blk + 32 + 32 * l + 2 * VCOLS * part);
            /* -32 * (sc[2 l] bsums[2 l] + sc[2 l + 1] bsums[2 l + 1]): the codes' offset, exact in int32 */
            const IVEC minus32 = ISLL16(ISUB16(IZERO(), pairs), 5);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
                sumi[r] = dpwssd_bcast(sumi[r], minus32, job->qb + (at0 + r) * 16 + 2 * l);
            for (int odd = 0; odd < 2; odd++) {
                const int g = 2 * l + odd;
                const IVEC lo0 = ILOAD(blk + 288 + 64 * (2 * g) + VBYTES * part);
                const IVEC lo1 = ILOAD(blk + 288 + 64 * (2 * g + 1) + VBYTES * part);
                const IVEC hi = ILOAD(blk + 2336 + 64 * g + VBYTES * part);
                const IVEC w[4] = {IOR(IAND(lo0, low4), IAND(ISLL16(hi, 4), top2)),
                                   IOR(IAND(lo1, low4), IAND(ISLL16(hi, 2), top2)),
                                   IOR(IAND(ISRL16(lo0, 4), low4), IAND(hi, top2)),
                                   IOR(IAND(ISRL16(lo1, 4), low4), IAND(ISRL16(hi, 2), top2))};
                const IVEC scale = q6k_scales(pairs, odd);
#if VCOLS == 16
                IVEC t[Q8WIDE];
                for (int r = 0; r < R; r++) t[r] = IZERO();
                for (int v = 0; v < 4; v++) {  /* step 4 g + v: weights 16 g + 4 v */
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++) t[r] = DOT_STEP(t[r], w[v], x + r * QK_K + 16 * g + 4 * v);
                }
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) sumi[r] = DOT_END(sumi[r], t[r], scale);
#else
#pragma GCC unroll 16
                for (int r = 0; r < R; r++)
                    for (int v0 = 0; v0 < 4; v0 += Q6_SPAN) {
                        IVEC t = IZERO();
                        for (int v = v0; v < v0 + Q6_SPAN; v++) t = DOT_STEP(t, w[v], x + r * QK_K + 16 * g + 4 * v);
                        sumi[r] = DOT_END(sumi[r], t, scale);
                    }
#endif
            }
        }
        const FVEC d = HALVES(blk + 2 * VCOLS * part);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const FVEC dy = FSET1(job->qd[at0 + r]);
            acc[r] = FADD(acc[r], FMUL(FMUL(dy, d), ICVT(sumi[r])));
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

#define TILES(R)                                                                                               \
    static void q4k_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q4k_tile(j, g, m0, R, part, out, 0); } \
    static void q5k_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q4k_tile(j, g, m0, R, part, out, 1); } \
    static void q6k_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q6k_tile(j, g, m0, R, part, out); }
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6) TILES(7) TILES(8)
TILES(9) TILES(10) TILES(11) TILES(12) TILES(13) TILES(14) TILES(15) TILES(16)
#define KTABLE(k) {0, k##_tile_1, k##_tile_2, k##_tile_3, k##_tile_4, k##_tile_5, k##_tile_6, k##_tile_7, k##_tile_8, \
                   k##_tile_9, k##_tile_10, k##_tile_11, k##_tile_12, k##_tile_13, k##_tile_14, k##_tile_15, k##_tile_16}
static const q8_tile_fn q4k_tiles[Q8WIDE + 1] = KTABLE(q4k), q5k_tiles[Q8WIDE + 1] = KTABLE(q5k),
                        q6k_tiles[Q8WIDE + 1] = KTABLE(q6k);

/* Column groups [begin, end) of a q8_job (columns 16 g .. 16 g + 15 of the repacked matrix): every row
 * against each group's blocks: up to Q8WIDE rows in one tile, more Q8TILE at a time (see q8_groups). */
void KQ(q8_range)(const void *arg, int64_t begin, int64_t end)
{
    const q8_job *job = arg;
    if (ggml_is_q32(job->kind)) {
        KQ(q32_range)(arg, begin, end);  /* quant32_q8.c */
        return;
    }
    const int kind = job->kind;
#if VCOLS == 16
    if (q8_amx && job->M >= q8_amx && q8_amx_range(job, begin, end) == 0) return;
#endif
    const q8_tile_fn *tiles = kind == GGML_Q6_K ? q6k_tiles : kind == GGML_Q5_K ? q5k_tiles : q4k_tiles;
    q8_groups(job, begin, end, tiles, job->K / QK_K, q8_group_bytes(kind), Q8WIDE);
}
