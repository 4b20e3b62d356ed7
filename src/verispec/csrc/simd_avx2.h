/* AVX2+FMA mapping of the vector vocabulary (see simd.h): 8 float lanes, 16 vector registers.
 * Also included by the AVX2-only sources (kquant.c, int4_avx2.c) for its helpers. */
#ifndef VS_SIMD_AVX2_H
#define VS_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#define VEC __m256
#define LANES 8
/* tile shapes (see simd_avx512.h): 16 registers hold 2 x 4 accumulators, or 3 x 4 with one weight
 * vector loaded at a time */
#define MAXMR 3
#define ROWS 6
#define FULLMR 2
#define QTILE 4
#define DVECS 2

#define VZERO _mm256_setzero_ps
#define VSET1 _mm256_set1_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMUL _mm256_mul_ps
#define VDIV _mm256_div_ps
#define VFMA _mm256_fmadd_ps  /* VFMA(a, b, c) = a * b + c, one rounding */
#define VMAX _mm256_max_ps
#define VMIN _mm256_min_ps
#define VHSUM hsum256
#define VLOADN loadn256
#define VSTOREN storen256
#define VKEEPN keepn256
#define VROUND round256
#define VPOW2MUL pow2mul256
#define VLOAD_BF16 bf16load256
#define VLOADN_BF16 bf16loadn256
#define VLOAD_I8 i8load256
#define VLOADN_I8 i8loadn256
#define I4TABLE i4table256
#define I4UNPACK i4unpack256
#define Q4KWEIGHTS q4kweights256
#define Q6KWEIGHTS q6kweights256

static inline __m256i mask256(int64_t n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline __m256 loadn256(const float *p, int64_t n) { return _mm256_maskload_ps(p, mask256(n)); }
static inline void storen256(float *p, __m256 v, int64_t n) { _mm256_maskstore_ps(p, mask256(n), v); }
static inline __m256 keepn256(__m256 v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(mask256(n))); }
static inline __m256 round256(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline __m256 pow2mul256(__m256 p, __m256 n)
{   /* 2^n built in the exponent field; n is within [-126, 127] after exp's clamp */
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline __m256 bf16load256(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 bf16loadn256(const uint16_t *p, int64_t n)
{
    uint16_t part[8] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return bf16load256(part);
}
static inline __m256 i8load256(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 i8loadn256(const int8_t *p, int64_t n)
{
    int8_t part[8] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return i8load256(part);
}
/* One Q4_K weight vector: 8 codes (the low nibbles, shift 0, or the high ones, shift 4), rebuilt. */
static inline __m256 q4kweights256(const uint8_t *p, int shift, __m256 scale, __m256 min)
{
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(bytes, shift), _mm256_set1_epi32(15));
    return _mm256_sub_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(q)), min);
}
/* One Q6_K weight vector: 8 int8 codes, rebuilt. */
static inline __m256 q6kweights256(const int8_t *p, __m256 scale)
{
    return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))));
}
/* int4: (q - 8) converted exactly, times the group's scale (one rounding, as the table lookup) */
static inline __m256 i4table256(float scale) { return _mm256_set1_ps(scale); }
static inline void i4unpack256(const uint8_t *p, __m256 scale, __m256 *lo, __m256 *hi)
{
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), eight = _mm256_set1_epi32(8);
    *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), eight)), scale);
    *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight)), scale);
}
static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
