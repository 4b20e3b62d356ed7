/* ======== ggml's 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) times activations rounded as Q8_0 / Q8_1 ========
 * (compiled twice, as kquant_q8.c: -DVS_Q8_512 with AVX-512 BW + VNNI, -DVS_Q8_256 with AVX2)
 *
 * llama.cpp's numerics for these types, as its x86 build runs them (ggml-cpu/arch/x86/quants.c):
 * each activation row is rounded per block of 32 (quantize_row_q8_0 / _q8_1: max = the largest |x|,
 * d = max / 127, id = max ? 127 / max : 0, q = round-to-nearest-even(x * id), the block's scale the half
 * float of d, and for Q8_1 s = the half float of d * sum(q)), and each block's dot product is integer
 * arithmetic on the file's codes (ggml_vec_dot_q4_0_q8_0, _q4_1_q8_1, _q5_0_q8_0, _q5_1_q8_1, _q8_0_q8_0):
 *   sumi = sum_i w_i * q_i, with w the signed weight (Q4_0: code - 8, Q5_0: code - 16, Q8_0: the int8) or
 *   the unsigned code (Q4_1, Q5_1: codes 0..15 / 0..31, the block's min m added in float).
 * The integers are exact, so they are ggml's to the bit. The float part, per output y[m, n], with float32
 * rounding after every operation and no fused multiply-add, over the blocks b in order (ggml's generic
 * vec_dot, unfused):
 *   _0 types: acc += (d * dy) * float(sumi)   (and verispec's VS_Q3_0 blocks: w = code - 4, codes 0..7)
 *   _1 types: acc += (d * dy) * float(sumi) + m * sy
 *   y = acc + bias
 * (d, m the block's half-precision scale and min, dy, sy the row's). ggml's SIMD kernels sum their lanes
 * otherwise and fuse, so a result is within float32 rounding of llama.cpp's, not bitwise; both ISAs here
 * give the same bits.
 *
 * How: the blocks are repacked at load (quant32_q8_pack.c) with the k-quant kernels' layout: one int32
 * lane per output column, a vector holding 16 (AVX2: 8) columns' next four weights, which meet a row's
 * four activation bytes, broadcast, in one vpdpbusd (AVX2: vpmaddubsw, then vpmaddwd by ones). Codes are
 * kept unsigned (vpdpbusd multiplies unsigned weights by signed activations): the _0 types' offset (8, 16,
 * and for Q8_0 on VNNI the 128 of flipping its sign bit) comes off as offset * sum(q), exact in int32;
 * AVX2 multiplies Q8_0's signed weights as |w| times q with w's sign (vpsignb), as ggml does.
 *
 * Row independence: every output y[m, n] is that sequence of operations on row m's own Q8_0 blocks and
 * column n's blocks, whatever M and however threads split the groups of 16 columns. */
#include "common.h"
#include "kernels.h"

#include "q8_isa.h"

/* One block of 32 to Q8_0 / Q8_1 by llama.cpp's x86 quantize_row_q8_1, operation for operation: the
 * codes q [32], the half-precision d and s (as floats), and the codes' sum. */
static void q8_0_block(const float *x, int8_t *q, float *d, float *s, int16_t *sum)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], peak = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_extractf128_ps(peak, 1), _mm256_castps256_ps128(peak));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float max = _mm_cvtss_f32(h);
    const float scale = max / 127.f;
    const __m256 mul = _mm256_set1_ps(max != 0.0f ? 127.f / max : 0.0f);
    __m256i r[4];
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    const int codes_sum = _mm_cvtsi128_si32(t);
    /* int32 -> int8 (all within [-127, 127]): the packs interleave 128-bit lanes, the permute restores order */
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    *d = _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT));
    *s = _cvtsh_ss(_cvtss_sh(scale * (float)codes_sum, _MM_FROUND_TO_NEAREST_INT));
    *sum = (int16_t)codes_sum;
}

/* Rows of x [M, K] (K a multiple of 32) to Q8_0 / Q8_1: the codes qx, and qd, qs, qa per block, in slabs of
 * Q8SLAB rows (q8_at; see q8_job). */
void KQ(q8_0_quantize)(const float *x, int8_t *qx, float *qd, float *qs, int16_t *qa, int64_t M, int64_t K)
{
    const int64_t blocks = K / QK32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i = q8_at(m, b, blocks);
            q8_0_block(x + m * K + b * QK32, qx + i * QK32, qd + i, qs + i, qa + i);
        }
}

/* Where a repacked group's block keeps its parts (see quant32_q8_pack.c): d at 0, m at 32 (_1 types), the
 * codes after them, the fifth bits after the nibbles. */
INLINE int64_t codes_at(int kind) { return kind == GGML_Q4_1 || kind == GGML_Q5_1 ? 64 : 32; }

/* Part `part` (VCOLS columns) of a group's blocks of type `kind` against rows m0 .. m0 + R - 1: out[r] = acc. */
INLINE void q32_tile(const q8_job *job, const uint8_t *group, int64_t m0, const int R, int part, FVEC *out, const int kind)
{
    const int64_t K = job->K, blocks = K / QK32, size = Q8G * q32_block_bytes(kind), at = codes_at(kind);
    const int five = kind == GGML_Q5_0 || kind == GGML_Q5_1, ones = kind == GGML_Q4_1 || kind == GGML_Q5_1;
    const int eight = kind == GGML_Q8_0, three = kind == VS_Q3_0;
#if VCOLS == 16
    const int offset = kind == GGML_Q4_0 ? 8 : kind == GGML_Q5_0 ? 16 : eight ? 128 : three ? 4 : 0;
#else
    const int offset = kind == GGML_Q4_0 ? 8 : kind == GGML_Q5_0 ? 16 : three ? 4 : 0;
    const __m256i pairs = _mm256_set1_epi16(1);
#endif
    const IVEC low4 = ISET8(15);
    FVEC acc[Q8TILE];
    for (int r = 0; r < R; r++) acc[r] = FZERO();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = group + b * size;
        const int64_t at0 = q8_at(m0, b, blocks);  /* row m0 + r's block b: at0 + r (m0 starts a tile) */
        const int8_t *x = job->qx0 + at0 * QK32;
        /* 12 groups (3.5-6.5 KB) ahead, not the k-quants' 4 (9-13 KB): on the 0.5B Q4_0 draft (Intel Xeon,
         * 2 threads) 4 left its width-1 step at ~16 GB/s of ~20 the cores stream, 12 cut it 7% (AVX2: 7%) */
        if (part == 0) prefetch_block(blk, size, 0, 1, Q32_AHEAD);
        IVEC w[8];  /* step s: weights 4 s .. 4 s + 3 of each column */
        if (eight) {
            for (int s = 0; s < 8; s++) {
                w[s] = ILOAD(blk + at + 64 * s + VBYTES * part);
#if VCOLS == 16
                w[s] = _mm512_xor_si512(w[s], ISET8((char)0x80));  /* w + 128, unsigned */
#endif
            }
        } else if (three) {
            /* steps 2 h, 2 h + 1 in bits 0-2 and 3-5 of chunk h; steps 6 and 7 from bits 6-7 of chunks 0 and 1 and
             * bits 6 and 7 of chunk 2 (quant32_q8_pack.c; 16-bit shifts that keep each byte's bits in the byte) */
            const IVEC seven = ISET8(7), three_bits = ISET8(3), four = ISET8(4);
            IVEC chunk[3];
            for (int h = 0; h < 3; h++) {
                chunk[h] = ILOAD(blk + at + 64 * h + VBYTES * part);
                w[2 * h] = IAND(chunk[h], seven);
                w[2 * h + 1] = IAND(ISRL16(chunk[h], 3), seven);
            }
            w[6] = IOR(IAND(ISRL16(chunk[0], 6), three_bits), IAND(ISRL16(chunk[2], 4), four));
            w[7] = IOR(IAND(ISRL16(chunk[1], 6), three_bits), IAND(ISRL16(chunk[2], 5), four));
        } else {
            for (int u = 0; u < 4; u++) {
                const IVEC raw = ILOAD(blk + at + 64 * u + VBYTES * part);
                w[u] = IAND(raw, low4);
                w[4 + u] = IAND(ISRL16(raw, 4), low4);
                if (five) {
                    w[u] = IOR(w[u], fifth_bits(blk + at + 256 + 8 * u, part));
                    w[4 + u] = IOR(w[4 + u], fifth_bits(blk + at + 256 + 8 * (4 + u), part));
                }
            }
        }
        IVEC sumi[Q8TILE];
#if VCOLS == 16
        for (int r = 0; r < R; r++) sumi[r] = IZERO();
        for (int s = 0; s < 8; s++) {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) sumi[r] = dpbusd_bcast(sumi[r], w[s], x + r * QK32 + 4 * s);
        }
#else
        /* int16 pair sums: eight 4-bit (or 3-bit) steps fit (8 * 2 * 15 * 127), 5-bit four (4 * 2 * 31 * 127), Q8_0's
         * |w| * q one (2 * 128 * 127); then vpmaddwd by ones to int32 */
        const int span = eight ? 1 : five ? 4 : 8;
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            sumi[r] = IZERO();
            for (int s0 = 0; s0 < 8; s0 += span) {
                __m256i t = IZERO();
                for (int s = s0; s < s0 + span; s++) {
                    const __m256i a = bcast4(x + r * QK32 + 4 * s);
                    t = _mm256_add_epi16(t, eight ? _mm256_maddubs_epi16(_mm256_sign_epi8(w[s], w[s]), _mm256_sign_epi8(a, w[s]))
                                                  : _mm256_maddubs_epi16(w[s], a));
                }
                sumi[r] = IADD32(sumi[r], _mm256_madd_epi16(t, pairs));
            }
        }
#endif
        const FVEC d = HALVES(blk + 2 * VCOLS * part);
        const FVEC m = ones ? HALVES(blk + 32 + 2 * VCOLS * part) : FZERO();
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const int64_t row = at0 + r;
            IVEC exact = sumi[r];
            if (offset) exact = IADD32(exact, ISET32(-offset * job->qa0[row]));
            FVEC t = FMUL(FMUL(d, FSET1(job->qd0[row])), ICVT(exact));
            if (ones) t = FADD(t, FMUL(m, FSET1(job->qs0[row])));
            acc[r] = FADD(acc[r], t);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

#define TILES(R)                                                                                                      \
    static void q4_0_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q32_tile(j, g, m0, R, part, out, GGML_Q4_0); } \
    static void q4_1_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q32_tile(j, g, m0, R, part, out, GGML_Q4_1); } \
    static void q5_0_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q32_tile(j, g, m0, R, part, out, GGML_Q5_0); } \
    static void q5_1_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q32_tile(j, g, m0, R, part, out, GGML_Q5_1); } \
    static void q8_0_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q32_tile(j, g, m0, R, part, out, GGML_Q8_0); } \
    static void q3_0_tile_##R(const q8_job *j, const uint8_t *g, int64_t m0, int part, FVEC *out) { q32_tile(j, g, m0, R, part, out, VS_Q3_0); }
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6) TILES(7) TILES(8)
#define TABLE(t) {0, t##_tile_1, t##_tile_2, t##_tile_3, t##_tile_4, t##_tile_5, t##_tile_6, t##_tile_7, t##_tile_8}
static const q8_tile_fn q4_0_tiles[Q8TILE + 1] = TABLE(q4_0), q4_1_tiles[Q8TILE + 1] = TABLE(q4_1),
                        q5_0_tiles[Q8TILE + 1] = TABLE(q5_0), q5_1_tiles[Q8TILE + 1] = TABLE(q5_1),
                        q8_0_tiles[Q8TILE + 1] = TABLE(q8_0), q3_0_tiles[Q8TILE + 1] = TABLE(q3_0);

/* Column groups [begin, end) of a q8_job of a 32-weight type: every row against each group's blocks,
 * Q8TILE rows at a time, as kquant_q8.c's q8_range. */
void KQ(q32_range)(const void *arg, int64_t begin, int64_t end)
{
    const q8_job *job = arg;
    const int kind = job->kind;
    const q8_tile_fn *tiles = kind == GGML_Q4_0 ? q4_0_tiles : kind == GGML_Q4_1 ? q4_1_tiles : kind == GGML_Q5_0 ? q5_0_tiles
                            : kind == GGML_Q5_1 ? q5_1_tiles : kind == VS_Q3_0 ? q3_0_tiles : q8_0_tiles;
    q8_groups(job, begin, end, tiles, job->K / QK32, Q8G * q32_block_bytes(kind), Q8TILE);
}
