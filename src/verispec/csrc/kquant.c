/* ======== GGUF k-quant blocks, widened to the very float32 weights they stand for ========
 * (AVX2+FMA, whatever the caller's ISA)
 * A model converted from a GGUF file holds float32 weights that gguf's reference dequantizer
 * computed from the file's blocks. Kept as those blocks, a weight is rebuilt here with the same
 * operations, rounded the same way (the library is built with -ffp-contract=off, so nothing fuses):
 * q4k: codes [N, K / 2] in 64-weight groups, byte j holding weight j (low nibble) and weight j + 32
 *      (high), the Q4_K super-block order; sm [N, K / 32, 2] each 32-weight sub-block's (scale, min),
 *      w = (scale * q) - min with q in [0, 15].
 * q6k: codes [N, K] int8, q in [-32, 31]; s [N, K / 16] a scale per 16 weights, w = scale * q.
 * Rows [0, rows) starting at w, k in [k0, k1) (whole groups), to out [rows][K] (row stride K).
 * `ahead` rows of codes and scales past the last one are fetched into cache meanwhile (the next
 * tile's: the widened rows are short pieces at a stride, which the hardware prefetcher follows late). */
#include "common.h"
#include "kernels.h"
#include "simd_avx2.h"

void widen_q4k(const void *w, const float *sm, int64_t K, int rows, int64_t k0, int64_t k1, float *out, int ahead)
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

void widen_q6k(const void *w, const float *s, int64_t K, int rows, int64_t k0, int64_t k1, float *out, int ahead)
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

/* The first row of the exact k-quant matrix (format VS_Q4K or VS_Q6K) whose rebuilt weights differ
 * from `dense` [N, K] in any bit; N when none does; -1 when scratch memory ran out. */
int64_t exact_blocks_mismatch(const void *w, const float *s, const float *dense, int64_t N, int64_t K, int format)
{
    float *wide = malloc(sizeof(float) * (size_t)(K ? K : 1));
    if (!wide) return -1;
    int64_t n = 0;
    for (; n < N; n++) {
        if (format == VS_Q4K) widen_q4k((const uint8_t *)w + n * (K / 2), s + n * (K / 16), K, 1, 0, K, wide, 0);
        else widen_q6k((const int8_t *)w + n * K, s + n * (K / 16), K, 1, 0, K, wide, 0);
        if (memcmp(wide, dense + n * K, sizeof(float) * (size_t)K)) break;
    }
    free(wide);
    return n;
}
