/* ======== rows of a GGUF file's Q4_K / Q5_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrix, dequantized to float32 ========
 * (baseline C: an embedding lookup reads a handful of rows per step)
 *
 * ggml's dequantize_row_q4_K / _q5_K / _q6_K, term for term and in the same float order (d * sc, then
 * times the code, minus dmin * m; Q6_K: (d * sc) * (q - 32)), so a row is bitwise what gguf-py's numpy
 * dequantize and ggml give. Half floats are widened in software, exactly (no F16C needed here). */
#include "common.h"
#include "kernels.h"

static float half_to_float(const uint8_t *p)
{
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    uint32_t bits;
    if (exponent == 31) {
        bits = sign | 0x7f800000u | mantissa << 13;  /* inf, nan */
    } else if (exponent) {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    } else if (mantissa) {  /* subnormal: normalize */
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 1024)) { m <<= 1; shift++; }
        bits = sign | (uint32_t)(113 - shift) << 23 | (m & 1023) << 13;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)  /* ggml's get_scale_min_k4 */
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One Q4_K (fifth = NULL) or Q5_K block -> 256 floats. */
static void block_q45k(const uint8_t *b, const uint8_t *fifth, const uint8_t *qs, float *y)
{
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *scales = b + 4;
    uint8_t sc, m, u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, qs += 32, u1 <<= 2, u2 <<= 2) {
        scale_min_k4(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)((qs[l] & 15) + (fifth && (fifth[l] & u1) ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)((qs[l] >> 4) + (fifth && (fifth[l] & u2) ? 16 : 0)) - m2;
    }
}

/* One Q6_K block (ql[128], qh[64], scales[16] int8, d) -> 256 floats. */
static void block_q6k(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8)
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32;
            const int q2 = (int)((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32;
            const int q3 = (int)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            y[l] = d * sc[is] * (float)q1;
            y[l + 32] = d * sc[is + 2] * (float)q2;
            y[l + 64] = d * sc[is + 4] * (float)q3;
            y[l + 96] = d * sc[is + 6] * (float)q4;
        }
}

/* One block of a 32-weight type -> 32 floats: ggml's dequantize_row_q4_0 / _q4_1 / _q5_0 / _q5_1 / _q8_0
 * (weight j < 16 from qs[j]'s low nibble, j + 16 from its high one; Q5's fifth bit j of qh as 16; the _0
 * types' codes less 8 or 16 times d, the _1 types' codes times d plus m). */
static void block_q32(const uint8_t *b, int kind, float *y)
{
    const float d = half_to_float(b);
    if (kind == VS_Q3_0) {  /* weight j: bits 2 (j % 4) of byte j / 4, and bit j % 8 of byte 8 + j / 8 as 4; less 4, times d */
        for (int j = 0; j < QK32; j++) {
            const int code = ((b[2 + j / 4] >> (2 * (j % 4))) & 3) | ((b[10 + j / 8] >> (j % 8)) & 1) << 2;
            y[j] = (float)(code - 4) * d;
        }
        return;
    }
    if (kind == GGML_Q8_0) {
        for (int j = 0; j < QK32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    const int ones = kind == GGML_Q4_1 || kind == GGML_Q5_1, five = kind == GGML_Q5_0 || kind == GGML_Q5_1;
    const float m = ones ? half_to_float(b + 2) : 0.0f;
    const uint8_t *after = b + (ones ? 4 : 2);
    uint32_t qh = 0;
    if (five) memcpy(&qh, after, 4);
    const uint8_t *qs = after + (five ? 4 : 0);
    const int offset = ones ? 0 : five ? 16 : 8;
    for (int j = 0; j < QK32 / 2; j++) {
        const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        if (ones) {
            y[j] = (float)lo * d + m;
            y[j + 16] = (float)hi * d + m;
        } else {
            y[j] = (float)(lo - offset) * d;
            y[j + 16] = (float)(hi - offset) * d;
        }
    }
}

int gguf_dequantize_rows(const uint8_t *blocks, const int64_t *ids, int64_t n, int64_t N, int64_t K, int kind, float *out)
{
    if (ggml_is_q32(kind)) {
        if (K % QK32) return 1;
        const int64_t bytes = q32_block_bytes(kind);
        for (int64_t r = 0; r < n; r++) {
            if (ids[r] < 0 || ids[r] >= N) return 2;
            for (int64_t b = 0; b < K / QK32; b++) block_q32(blocks + (ids[r] * (K / QK32) + b) * bytes, kind, out + r * K + b * QK32);
        }
        return 0;
    }
    const int64_t size = kind == GGML_Q4_K ? Q4K_BYTES : kind == GGML_Q5_K ? Q5K_BYTES : kind == GGML_Q6_K ? Q6K_BYTES : 0;
    if (!size || K % QK_K) return 1;
    for (int64_t r = 0; r < n; r++) {
        if (ids[r] < 0 || ids[r] >= N) return 2;
        const uint8_t *row = blocks + ids[r] * (K / QK_K) * size;
        for (int64_t b = 0; b < K / QK_K; b++) {
            const uint8_t *block = row + b * size;
            float *y = out + r * K + b * QK_K;
            if (kind == GGML_Q4_K) block_q45k(block, NULL, block + 16, y);
            else if (kind == GGML_Q5_K) block_q45k(block, block + 16, block + 48, y);
            else block_q6k(block, y);
        }
    }
    return 0;
}
