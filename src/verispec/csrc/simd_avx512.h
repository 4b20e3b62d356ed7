/* AVX-512F mapping of the vector vocabulary (see simd.h): 16 float lanes, 32 vector registers. */
#ifndef VS_SIMD_AVX512_H
#define VS_SIMD_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#define VEC __m512
#define LANES 16
/* tile shapes: activation rows per pass of the int4 and widened k-quant tiles (MAXMR), of the other
 * row tiles (ROWS), rows that still fit 4 weight rows' accumulators (FULLMR: 32 registers hold 6 x 4),
 * queries per attention score tile (QTILE), vectors of d per attention output tile (DVECS) */
#define MAXMR 6
#define ROWS 6
#define FULLMR 6
#define QTILE 8
#define DVECS 4

#define VZERO _mm512_setzero_ps
#define VSET1 _mm512_set1_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMUL _mm512_mul_ps
#define VDIV _mm512_div_ps
#define VFMA _mm512_fmadd_ps  /* VFMA(a, b, c) = a * b + c, one rounding */
#define VMAX _mm512_max_ps
#define VMIN _mm512_min_ps
#define VHSUM _mm512_reduce_add_ps
#define VLOADN loadn512      /* the first n lanes, the rest zero */
#define VSTOREN storen512    /* the first n lanes */
#define VKEEPN keepn512      /* the first n lanes kept, the rest zeroed */
#define VROUND round512      /* to nearest, ties to even */
#define VPOW2MUL pow2mul512  /* p * 2^n for integral n */
#define VLOAD_BF16 bf16load512
#define VLOADN_BF16 bf16loadn512
#define VLOAD_I8 i8load512
#define VLOADN_I8 i8loadn512
#define I4TABLE i4table512
#define I4UNPACK i4unpack512
#define Q4KWEIGHTS q4kweights512
#define Q6KWEIGHTS q6kweights512

static inline __mmask16 mask512(int64_t n) { return (__mmask16)((1u << n) - 1u); }
static inline __m512 loadn512(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(mask512(n), p); }
static inline void storen512(float *p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, mask512(n), v); }
static inline __m512 keepn512(__m512 v, int64_t n) { return _mm512_maskz_mov_ps(mask512(n), v); }
static inline __m512 round512(__m512 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline __m512 pow2mul512(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }
/* bfloat16 -> float32 is exact: the 16 bits become the top half of the float */
static inline __m512 bf16load512(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 bf16loadn512(const uint16_t *p, int64_t n)
{
    uint16_t part[16] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return bf16load512(part);
}
/* int8 -> float32 is exact; the row's scale is applied once, to the finished sum */
static inline __m512 i8load512(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 i8loadn512(const int8_t *p, int64_t n)
{
    int8_t part[16] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return i8load512(part);
}
/* exact k-quant weights rebuilt in registers, as widen_q4k / widen_q6k do (16 bytes of codes) */
static inline __m512 q4kweights512(const uint8_t *p, int shift, __m512 scale, __m512 min)
{
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(bytes, shift), _mm512_set1_epi32(15));
    return _mm512_sub_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(q)), min);
}
static inline __m512 q6kweights512(const int8_t *p, __m512 scale)
{
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
}
/* int4: a group's 16 possible weights (q - 8) * scale, looked up by nibble in one permute */
static inline __m512 i4table512(float scale)
{
    return _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_ps(scale));
}
static inline void i4unpack512(const uint8_t *p, __m512 table, __m512 *lo, __m512 *hi)
{
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

#endif
