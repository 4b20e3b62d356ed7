/* ======== GGUF k-quant blocks as they lie in the file, times activations rounded as ggml's Q8_K ========
 * (compiled twice: -DVS_Q8_512 with AVX-512 BW + VNNI, -DVS_Q8_256 with AVX2; see kernels/build.py)
 *
 * llama.cpp's numerics for a Q4_K / Q6_K matrix: each activation row is rounded to 8 bits per block
 * of 256 (ggml's quantize_row_q8_K_ref: amax over the block, the value of largest magnitude `max`,
 * iscale = -127 / max, q = min(127, nearest_int(iscale * x)), d = 1 / iscale, and the sums of q per
 * 16), and each block's dot product is integer arithmetic on the file's codes:
 *   Q4_K: sumi = sum_j sc[j] * sum_{32 of sub-block j} q4 * q8,  summ = sum_j m[j] * (bsums of sub-block j)
 *         block value = (dy * d) * sumi - (dy * dmin) * summ
 *   Q6_K: sumi = sum_g sc[g] * sum_{16 of group g} (q6 - 32) * q8, block value = (dy * d) * sumi
 * (dy the row's Q8_K scale, d and dmin the block's half-precision scales). The integers are exact, so
 * they are ggml's to the bit; the float part follows ggml's AVX2 kernels' shape (the integer sums kept
 * in LANES int32 lanes, each lane scaled by the block's float scale and added to its own float
 * accumulator, lanes summed at the end), but with a separate multiply and add (ggml fuses them) and
 * lanes summed in order 0, 1, 2, ...: a result is within float32 rounding of llama.cpp's, not bitwise.
 *
 * Which lane an integer lands in: weight p of a block (0..255) in lane (p % (4 LANES)) / 4; Q4_K's
 * mins in a second accumulator of 4 lanes, lane l = m[2l] bs[2l] + m[2l+1] bs[2l+1] (bs: the sums of
 * 32); Q6_K's -32 as 32 * (sc[2l] bsums[2l] + sc[2l+1] bsums[2l+1]) subtracted from lane l (l < 8)
 * before the float scaling. y = (acc[0] + acc[1] + ... ) - (accm[0] + ... + accm[3]) + bias.
 *
 * Row independence: every output y[m, n] is that sequence of operations on row m's own Q8_K blocks
 * and column n's blocks, whatever M and however threads split the columns (they split columns only).
 * Rows run in tiles of up to Q8TILE sharing each decoded weight chunk; a tile's rows never meet. */
#include "common.h"
#include "kernels.h"

#if defined(VS_Q8_512)
#define QLANES 16
#define KQ(name) name##_512
typedef __m512i IVEC;
#define ILOAD(p) _mm512_loadu_si512((const void *)(p))
#define IZERO _mm512_setzero_si512
#define IMADDUBS _mm512_maddubs_epi16
#define IDPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)  /* acc + pairwise a * b, int16 -> int32 */
#define IMADD _mm512_madd_epi16
#define ISUB _mm512_sub_epi32
#define ICVT _mm512_cvtepi32_ps
typedef __m512 FVEC;
#define FZERO _mm512_setzero_ps
#define FMUL _mm512_mul_ps
#define FADD _mm512_add_ps
#define FSET1 _mm512_set1_ps
#define FSTORE _mm512_storeu_ps
#define FROM256(v) _mm512_zextsi256_si512(v)
#elif defined(VS_Q8_256)
#define QLANES 8
#define KQ(name) name##_256
typedef __m256i IVEC;
#define ILOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define IZERO _mm256_setzero_si256
#define IMADDUBS _mm256_maddubs_epi16
#define IDPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define IMADD _mm256_madd_epi16
#define ISUB _mm256_sub_epi32
#define ICVT _mm256_cvtepi32_ps
typedef __m256 FVEC;
#define FZERO _mm256_setzero_ps
#define FMUL _mm256_mul_ps
#define FADD _mm256_add_ps
#define FSET1 _mm256_set1_ps
#define FSTORE _mm256_storeu_ps
#define FROM256(v) (v)
#else
#error "kquant_q8.c: compile with -DVS_Q8_512 (AVX-512 BW + VNNI) or -DVS_Q8_256 (AVX2)"
#endif

#define CHUNK (4 * QLANES)       /* weights per integer vector: 64 or 32 */
#define CHUNKS (QK_K / CHUNK)    /* chunks per block */
#define Q8TILE 4                 /* activation rows per pass over a column's blocks */

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* ggml's nearest_int: round to nearest, ties to even, for |f| < 2^22 (here |f| <= 127) */
static inline int nearest_int(float f)
{
    const float shifted = f + 12582912.f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    return (bits & 0x007fffff) - 0x00400000;
}

/* Rows [begin, end) of x [M, K] to Q8_K: qx [M, K] int8, qd [M, K / 256] the scales d, qb [M, K / 16]
 * the sums of 16 codes, qb32 [M, K / 32] the sums of 32 (both int16). ggml's reference, operation for
 * operation (scalar: the few thousand operations of a row are nothing beside its products). */
void KQ(q8k_quantize)(const float *x, int8_t *qx, float *qd, int16_t *qb, int16_t *qb32, int64_t M, int64_t K)
{
    const int64_t blocks = K / QK_K;
    for (int64_t i = 0; i < M * blocks; i++) {
        const float *v = x + i * QK_K;
        int8_t *q = qx + i * QK_K;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            const float a = fabsf(v[j]);
            if (a > amax) { amax = a; max = v[j]; }
        }
        if (amax == 0.0f) {
            qd[i] = 0.0f;
            memset(q, 0, QK_K);
        } else {
            const float iscale = -127.f / max;
            for (int j = 0; j < QK_K; j++) {
                const int r = nearest_int(iscale * v[j]);
                q[j] = (int8_t)(r < 127 ? r : 127);
            }
            qd[i] = 1.0f / iscale;
        }
        for (int g = 0; g < QK_K / 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += q[g * 16 + j];
            qb[i * (QK_K / 16) + g] = (int16_t)sum;
        }
        for (int g = 0; g < QK_K / 32; g++)
            qb32[i * (QK_K / 32) + g] = (int16_t)(qb[i * (QK_K / 16) + 2 * g] + qb[i * (QK_K / 16) + 2 * g + 1]);
    }
}

static inline float hsum_lanes(FVEC v)
{
    float lanes[QLANES], sum = 0.0f;
    FSTORE(lanes, v);
    for (int l = 0; l < QLANES; l++) sum += lanes[l];
    return sum;
}

/* ---- Q4_K: d, dmin (f16), 12 bytes of 6-bit (scale, min) codes, 128 bytes of nibbles ---- */

/* The eight 6-bit scales and mins of a Q4_K block (ggml's get_scale_min_k4, all eight at once). */
static inline void q4k_scales(const uint8_t *packed, uint8_t sc[8], uint8_t mn[8])
{
    for (int j = 0; j < 4; j++) {
        sc[j] = packed[j] & 63;
        mn[j] = packed[j + 4] & 63;
        sc[j + 4] = (packed[j + 8] & 15) | ((packed[j] >> 6) << 4);
        mn[j + 4] = (packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4);
    }
}

/* Chunk c of a Q4_K block's codes, in weight order (values 0..15), and its scale words. */
static inline IVEC q4k_chunk(const uint8_t *qs, int c)
{
#if QLANES == 16
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));  /* weights 64c .. 64c + 63 */
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(15));
#else
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c / 2)));  /* weights 32c .. 32c + 31 */
    return _mm256_and_si256(c % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(15));
#endif
}

/* The scale words of chunk c (one int16 per pair of weights, for IDPWSSD) from the block's scales as
 * words (`words`: Q4_K's eight, zero-extended; Q6_K's sixteen). */
static inline IVEC q4k_chunk_scales(__m128i words, int c)
{
#if QLANES == 16
    /* words 0..15 take scale 2c, 16..31 scale 2c + 1 */
    const __m512i index = _mm512_add_epi16(_mm512_set1_epi16((short)(2 * c)),
                                           _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1));
    return _mm512_permutexvar_epi16(index, _mm512_castsi128_si512(words));
#else
    /* every word takes scale c: its two bytes picked from each 128-bit lane's copy of the words */
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(words), _mm256_set1_epi16((short)((2 * c) | ((2 * c + 1) << 8))));
#endif
}

/* ---- Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (f16) ---- */

/* Chunk c of a Q6_K block's codes in weight order, unsigned (q + 32, 0..63). Weight 128 h + i of half h
 * takes, for i < 64, the low nibble of ql[64 h + i] and, for i >= 64, the high nibble of ql[64 h + i - 64];
 * its top two bits are bits 2 (i / 32) .. +1 of qh[32 h + i % 32]. */
static inline IVEC q6k_chunk(const uint8_t *ql, const uint8_t *qh, int c)
{
    const __m256i mask4 = _mm256_set1_epi8(15), mask_top = _mm256_set1_epi8(0x30);
#if QLANES == 16
    const int h = c / 2, upper = c % 2;
    const __m512i low = _mm512_loadu_si512((const void *)(ql + 64 * h));
    const __m256i high = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
    /* bytes 0..31 for weights i, 32..63 for weights i + 32: qh, and qh shifted down two bits */
    const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(high), _mm256_srli_epi16(high, 2), 1);
    const __m512i nib = _mm512_and_si512(upper ? _mm512_srli_epi16(low, 4) : low, _mm512_set1_epi8(15));
    const __m512i top = _mm512_and_si512(upper ? pairs : _mm512_slli_epi16(pairs, 4), _mm512_set1_epi8(0x30));
    (void)mask4; (void)mask_top;
    return _mm512_or_si512(nib, top);
#else
    const int h = c / 4, part = c % 4;  /* weights 128 h + 32 part .. + 31 */
    const __m256i low = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (part % 2)));
    const __m256i high = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
    const __m256i nib = _mm256_and_si256(part >= 2 ? _mm256_srli_epi16(low, 4) : low, mask4);
    __m256i top;
    switch (part) {  /* ((qh >> 2 part) & 3) << 4 */
    case 0: top = _mm256_slli_epi16(high, 4); break;
    case 1: top = _mm256_slli_epi16(high, 2); break;
    case 2: top = high; break;
    default: top = _mm256_srli_epi16(high, 2); break;
    }
    return _mm256_or_si256(nib, _mm256_and_si256(top, mask_top));
#endif
}

static inline IVEC q6k_chunk_scales(__m256i words, int c)
{
#if QLANES == 16
    /* words 8j .. 8j + 7 take scale 4c + j */
    const __m512i index = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * c)),
                                           _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                                              15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
    return _mm512_permutexvar_epi16(index, _mm512_castsi256_si512(words));
#else
    /* words 0..7 take scale 2c, 8..15 scale 2c + 1: dword c holds both, spread to every dword, then split by lane */
    const __m256i both = _mm256_permutevar8x32_epi32(words, _mm256_set1_epi32(c));
    return _mm256_shuffle_epi8(both, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                      2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
#endif
}

/* One column (a weight row of `blocks` blocks) against activation rows m0 .. m0 + MR - 1: y[i * ldy]. */
#define Q4K_ROWS(MR)                                                                                           \
static void q4k_rows_##MR(const q8_job *job, int64_t m0, const uint8_t *w, float *y, int64_t ldy, float bias)  \
{                                                                                                              \
    const int64_t K = job->K, blocks = K / QK_K;                                                               \
    FVEC acc[MR];                                                                                              \
    __m128 accm[MR];                                                                                           \
    for (int i = 0; i < MR; i++) { acc[i] = FZERO(); accm[i] = _mm_setzero_ps(); }                             \
    for (int64_t b = 0; b < blocks; b++) {                                                                     \
        const uint8_t *block = w + b * Q4K_BYTES;                                                              \
        uint16_t dh, mh;                                                                                       \
        memcpy(&dh, block, 2);                                                                                 \
        memcpy(&mh, block + 2, 2);                                                                             \
        const float d = half_to_float(dh), dmin = half_to_float(mh);                                           \
        uint8_t sc[8], mn[8];                                                                                  \
        q4k_scales(block + 4, sc, mn);                                                                         \
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));                         \
        const __m128i scale_words = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc));                  \
        IVEC sumi[MR];                                                                                         \
        for (int i = 0; i < MR; i++) sumi[i] = IZERO();                                                        \
        for (int c = 0; c < CHUNKS; c++) {                                                                     \
            const IVEC q = q4k_chunk(block + 16, c), s = q4k_chunk_scales(scale_words, c);                              \
            for (int i = 0; i < MR; i++) {                                                                     \
                const IVEC xq = ILOAD(job->qx + (m0 + i) * K + b * QK_K + c * CHUNK);                          \
                sumi[i] = IDPWSSD(sumi[i], IMADDUBS(q, xq), s);                                                \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < MR; i++) {                                                                         \
            const int64_t row = (m0 + i) * blocks + b;                                                         \
            const float dy = job->qd[row];                                                                     \
            acc[i] = FADD(acc[i], FMUL(FSET1(dy * d), ICVT(sumi[i])));                                         \
            const __m128i bs = _mm_loadu_si128((const __m128i *)(job->qb32 + row * 8));                        \
            const __m128 m = _mm_cvtepi32_ps(_mm_madd_epi16(mins, bs));                                        \
            accm[i] = _mm_add_ps(accm[i], _mm_mul_ps(_mm_set1_ps(dy * dmin), m));                              \
        }                                                                                                      \
    }                                                                                                          \
    for (int i = 0; i < MR; i++) {                                                                             \
        float lanes[4];                                                                                        \
        _mm_storeu_ps(lanes, accm[i]);                                                                         \
        const float low = ((lanes[0] + lanes[1]) + lanes[2]) + lanes[3];                                       \
        y[i * ldy] = (hsum_lanes(acc[i]) - low) + bias;                                                        \
    }                                                                                                          \
}

#define Q6K_ROWS(MR)                                                                                           \
static void q6k_rows_##MR(const q8_job *job, int64_t m0, const uint8_t *w, float *y, int64_t ldy, float bias)  \
{                                                                                                              \
    const int64_t K = job->K, blocks = K / QK_K;                                                               \
    FVEC acc[MR];                                                                                              \
    for (int i = 0; i < MR; i++) acc[i] = FZERO();                                                             \
    for (int64_t b = 0; b < blocks; b++) {                                                                     \
        const uint8_t *block = w + b * Q6K_BYTES;                                                              \
        const int8_t *sc = (const int8_t *)(block + 192);                                                      \
        uint16_t dh;                                                                                           \
        memcpy(&dh, block + 208, 2);                                                                           \
        const float d = half_to_float(dh);                                                                     \
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));                    \
        IVEC sumi[MR];                                                                                         \
        for (int i = 0; i < MR; i++) {  /* -32 * sum_g sc[g] bsums[g], in lanes 0..7 */                        \
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(job->qb + ((m0 + i) * blocks + b) * 16));  \
            sumi[i] = ISUB(IZERO(), FROM256(_mm256_slli_epi32(_mm256_madd_epi16(scales, bs), 5)));             \
        }                                                                                                      \
        for (int c = 0; c < CHUNKS; c++) {                                                                     \
            const IVEC q = q6k_chunk(block, block + 128, c), s = q6k_chunk_scales(scales, c);                      \
            for (int i = 0; i < MR; i++) {                                                                     \
                const IVEC xq = ILOAD(job->qx + (m0 + i) * K + b * QK_K + c * CHUNK);                          \
                sumi[i] = IDPWSSD(sumi[i], IMADDUBS(q, xq), s);                                                \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < MR; i++) {                                                                         \
            const float dy = job->qd[(m0 + i) * blocks + b];                                                   \
            acc[i] = FADD(acc[i], FMUL(FSET1(dy * d), ICVT(sumi[i])));                                         \
        }                                                                                                      \
    }                                                                                                          \
    for (int i = 0; i < MR; i++) y[i * ldy] = hsum_lanes(acc[i]) + bias;                                       \
}

Q4K_ROWS(1) Q4K_ROWS(2) Q4K_ROWS(3) Q4K_ROWS(4)
Q6K_ROWS(1) Q6K_ROWS(2) Q6K_ROWS(3) Q6K_ROWS(4)

typedef void (*rows_fn)(const q8_job *, int64_t, const uint8_t *, float *, int64_t, float);
static const rows_fn q4k_rows[Q8TILE + 1] = {0, q4k_rows_1, q4k_rows_2, q4k_rows_3, q4k_rows_4};
static const rows_fn q6k_rows[Q8TILE + 1] = {0, q6k_rows_1, q6k_rows_2, q6k_rows_3, q6k_rows_4};

/* Columns [begin, end) of a q8_job: each column's blocks against every row, Q8TILE rows at a time
 * (the column's blocks are re-read from cache by the later tiles). */
void KQ(q8_range)(const void *arg, int64_t begin, int64_t end)
{
    const q8_job *job = arg;
    const int64_t row_bytes = job->K / QK_K * (job->kind == GGML_Q6_K ? Q6K_BYTES : Q4K_BYTES);
    const rows_fn *rows = job->kind == GGML_Q6_K ? q6k_rows : q4k_rows;
    for (int64_t n = begin; n < end; n++) {
        const uint8_t *w = job->w + n * row_bytes;
        const float bias = job->b ? job->b[n] : 0.0f;
        for (int64_t m0 = 0; m0 < job->M; m0 += Q8TILE) {
            const int mr = job->M - m0 < Q8TILE ? (int)(job->M - m0) : Q8TILE;
            rows[mr](job, m0, w, job->y + m0 * job->N + n, job->N, bias);
        }
    }
}
