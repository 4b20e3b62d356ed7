/* ======== a GGUF file's Q4_K / Q5_K / Q6_K blocks repacked for kquant_q8.c: 16 columns interleaved ========
 * (baseline C, run once at load)
 *
 * The q8 kernels multiply 16 output columns at once: one int32 lane per column, so the integer dot
 * products, the block scales and the float work of a block are one vector op for 16 columns
 * (llama.cpp's repack.cpp does the same with its block_q4_Kx8). Columns n = 16 g .. 16 g + 15 make group
 * g; block b of a group (its 16 columns' blocks b, 256 weights each) is Q4G_BYTES / Q6G_BYTES bytes
 * at (g * K / 256 + b) * size, so a thread streams a group front to back. Within a group's block, a
 * "step" s holds weights 4 s .. 4 s + 3 of every column: byte 4 c + t is column c's weight 4 s + t (the
 * four bytes vpdpbusd sums into lane c). Columns past N are zero blocks (their outputs are dropped).
 *
 * Q4_K (2368 bytes): d[16], dmin[16] (the file's half floats); sc[8][16] (sub-block j's 6-bit scale of
 *   column c); mn[4][16][2] (column c's mins 2 l, 2 l + 1, an int16 pair for vpdpwssd); then 32 chunks
 *   of 64 bytes, chunk 4 j + u holding step 8 j + u in its low nibbles and step 8 j + 4 + u in its high
 *   ones (sub-block j of 32 weights is chunks 4 j .. 4 j + 3).
 * Q5_K (2880 bytes): Q4_K's layout of the low four bits (the same d, dmin, sc, mn and chunks), then for
 *   chunk 4 j + u 16 bytes of fifth bits: a 64-bit word for its low nibbles' step, one for its high ones',
 *   bit 4 c + t the fifth bit of column c's weight t of that step (codes 0..31).
 * Q6_K (3360 bytes): d[16]; sc[8][16][2] (column c's int8 scales 2 l, 2 l + 1); 32 chunks of 64 bytes of
 *   low nibbles, chunk 2 g + u holding step 4 g + u (low nibbles) and 4 g + 2 + u (high); 16 vectors of
 *   64 bytes of high bit pairs, vector g holding step 4 g + v in bits 2 v, 2 v + 1 (sub-block g of 16
 *   weights: chunks 2 g, 2 g + 1 and high vector g). Codes are unsigned, q + 32 (0..63).
 * The AVX2 kernels read each 64-byte row as two halves of 8 columns. */
#include "common.h"
#include "kernels.h"

/* Column c's Q4_K block -> its place in a group's block. */
static void pack_q4k(const uint8_t *src, uint8_t *dst, int c)
{
    uint8_t q[QK_K], sc[8], mn[8];
    const uint8_t *p = src + 4, *qs = src + 16;
    for (int j = 0; j < 4; j++) {  /* ggml's get_scale_min_k4 */
        sc[j] = p[j] & 63;
        mn[j] = p[j + 4] & 63;
        sc[j + 4] = (p[j + 8] & 15) | ((p[j] >> 6) << 4);
        mn[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
    for (int g = 0; g < 4; g++)  /* 64 weights per 32 bytes: low nibbles first */
        for (int i = 0; i < 32; i++) {
            q[64 * g + i] = qs[32 * g + i] & 15;
            q[64 * g + 32 + i] = qs[32 * g + i] >> 4;
        }
    memcpy(dst + 2 * c, src, 2);
    memcpy(dst + 32 + 2 * c, src + 2, 2);
    for (int j = 0; j < 8; j++) dst[64 + 16 * j + c] = sc[j];
    for (int l = 0; l < 4; l++) {
        dst[192 + 32 * l + 2 * c] = mn[2 * l];
        dst[192 + 32 * l + 2 * c + 1] = mn[2 * l + 1];
    }
    for (int j = 0; j < 8; j++)
        for (int u = 0; u < 4; u++)
            for (int t = 0; t < 4; t++)
                dst[320 + 64 * (4 * j + u) + 4 * c + t] = q[32 * j + 4 * u + t] | q[32 * j + 16 + 4 * u + t] << 4;
}

/* Column c's Q5_K block -> its place in a group's block: its low four bits as a Q4_K block's, then its
 * fifth bits. ggml's dequantize_row_q5_K: weight 64 g + i (i < 32) is qs[32 g + i] & 15 plus bit 2 g of
 * qh[i] as 16; weight 64 g + 32 + i is qs[32 g + i] >> 4 plus bit 2 g + 1 of qh[i]. */
static void pack_q5k(const uint8_t *src, uint8_t *dst, int c)
{
    uint8_t q4[Q4K_BYTES], q[QK_K];
    memcpy(q4, src, 16);                       /* d, dmin, scales */
    memcpy(q4 + 16, src + 48, 128);            /* qs */
    pack_q4k(q4, dst, c);
    const uint8_t *qh = src + 16;
    for (int g = 0; g < 4; g++)
        for (int i = 0; i < 32; i++) {
            q[64 * g + i] = (qh[i] >> (2 * g)) & 1;
            q[64 * g + 32 + i] = (qh[i] >> (2 * g + 1)) & 1;
        }
    for (int j = 0; j < 8; j++)
        for (int u = 0; u < 4; u++)
            for (int t = 0; t < 4; t++) {
                const int bit = 4 * c + t;
                uint8_t *word = dst + Q4G_BYTES + 16 * (4 * j + u);
                word[bit / 8] |= (uint8_t)(q[32 * j + 4 * u + t] << (bit % 8));           /* low nibbles' step */
                word[8 + bit / 8] |= (uint8_t)(q[32 * j + 16 + 4 * u + t] << (bit % 8));  /* high nibbles' */
            }
}

/* Column c's Q6_K block -> its place in a group's block. */
static void pack_q6k(const uint8_t *src, uint8_t *dst, int c)
{
    uint8_t q[QK_K];
    const uint8_t *ql = src, *qh = src + 128;
    for (int h = 0; h < 2; h++)  /* weight 128 h + i: see ggml's dequantize_row_q6_K */
        for (int i = 0; i < 128; i++) {
            const int low = i < 64 ? ql[64 * h + i] & 15 : ql[64 * h + i - 64] >> 4;
            q[128 * h + i] = (uint8_t)(low | ((qh[32 * h + i % 32] >> (2 * (i / 32))) & 3) << 4);
        }
    memcpy(dst + 2 * c, src + 208, 2);
    for (int l = 0; l < 8; l++) {
        dst[32 + 32 * l + 2 * c] = src[192 + 2 * l];
        dst[32 + 32 * l + 2 * c + 1] = src[192 + 2 * l + 1];
    }
    for (int g = 0; g < 16; g++)
        for (int t = 0; t < 4; t++) {
            for (int u = 0; u < 2; u++)
                dst[288 + 64 * (2 * g + u) + 4 * c + t] = (q[16 * g + 4 * u + t] & 15) | (q[16 * g + 8 + 4 * u + t] & 15) << 4;
            uint8_t high = 0;
            for (int v = 0; v < 4; v++) high |= (q[16 * g + 4 * v + t] >> 4) << (2 * v);
            dst[2336 + 64 * g + 4 * c + t] = high;
        }
}

typedef struct { const uint8_t *blocks; uint8_t *packed; int64_t N, K; int kind; } repack_job;

static void repack_range(const void *arg, int64_t begin, int64_t end)
{
    const repack_job *job = arg;
    const int64_t blocks = job->K / QK_K;
    const int kind = job->kind;
    const int64_t size = q8_group_bytes(kind);
    const int64_t bytes = kind == GGML_Q6_K ? Q6K_BYTES : kind == GGML_Q5_K ? Q5K_BYTES : Q4K_BYTES, row = blocks * bytes;
    void (*pack)(const uint8_t *, uint8_t *, int) = kind == GGML_Q6_K ? pack_q6k : kind == GGML_Q5_K ? pack_q5k : pack_q4k;
    for (int64_t g = begin; g < end; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *dst = job->packed + (g * blocks + b) * size;
            memset(dst, 0, (size_t)size);
            for (int c = 0; c < Q8G && Q8G * g + c < job->N; c++)
                pack(job->blocks + (Q8G * g + c) * row + b * bytes, dst, c);
        }
}

int gguf_q8_repack(const uint8_t *blocks, uint8_t *packed, int64_t N, int64_t K, int kind, int threads)
{
    if (ggml_is_q32(kind)) return q32_repack(blocks, packed, N, K, kind, threads);
    if (K % QK_K || N < 0 || (kind != GGML_Q4_K && kind != GGML_Q5_K && kind != GGML_Q6_K)) return -1;
    const repack_job job = {blocks, packed, N, K, kind};
    const int64_t groups = (N + Q8G - 1) / Q8G;
    parallel_for(repack_range, &job, groups, groups / 64 + 1, threads);
    return 0;
}
