/* ======== a GGUF file's 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; and VS_Q3_0) repacked for quant32_q8.c ========
 * (baseline C, run once at load; gguf_q8_repack in kquant_q8_pack.c hands these types here)
 *
 * The k-quant kernels' layout (kquant_q8_pack.c) for blocks of 32: columns n = 16 g .. 16 g + 15 make group
 * g, and block b of a group (its 16 columns' blocks b) is 16 times the file's block size at
 * (g * K / 32 + b) * size, so the repacked matrix has exactly the file's bytes. A "step" s holds weights
 * 4 s .. 4 s + 3 of every column: byte 4 c + t is column c's weight 4 s + t. A group's block:
 *   d[16] (the file's half floats), for Q4_1 / Q5_1 m[16] (half floats), then the codes:
 *   Q4_0, Q4_1, Q5_0, Q5_1: 4 chunks of 64 bytes, chunk u holding step u in its low nibbles and step u + 4
 *     in its high ones (ggml's qs[j] holds weight j low and weight j + 16 high, so byte 4 c + t of chunk
 *     u is column c's qs[4 u + t] as the file has it); Q5_0 / Q5_1 then 8 words of 64 bits, word s bit
 *     4 c + t the fifth bit of column c's weight 4 s + t (bit 4 s + t of the file's qh).
 *   Q8_0: 8 steps of 64 bytes, the file's int8 weights.
 *   VS_Q3_0 (verispec's 3-bit draft blocks, no file has them; codes 0..7): 3 chunks of 64 bytes, chunk h holding
 *     steps 2 h and 2 h + 1 in bits 0-2 and 3-5; step 6's low two bits in bits 6-7 of chunk 0 and its high bit
 *     in bit 6 of chunk 2, step 7's in chunk 1 and bit 7 of chunk 2 (a step is one or two shifts and a mask).
 * Columns past N are zero blocks (their outputs are dropped). */
#include "common.h"
#include "kernels.h"

/* Column c's block of type kind -> its place in a group's block. */
static void pack_q32(const uint8_t *src, uint8_t *dst, int c, int kind)
{
    const int ones = kind == GGML_Q4_1 || kind == GGML_Q5_1, five = kind == GGML_Q5_0 || kind == GGML_Q5_1;
    const int64_t at = ones ? 64 : 32;
    memcpy(dst + 2 * c, src, 2);
    if (ones) memcpy(dst + 32 + 2 * c, src + 2, 2);
    const uint8_t *after = src + (ones ? 4 : 2);  /* qh (five), then qs */
    if (kind == VS_Q3_0) {  /* see the layout above */
        for (int s = 0; s < 8; s++)
            for (int t = 0; t < 4; t++) {
                const int j = 4 * s + t;
                const int code = ((after[j / 4] >> (2 * (j % 4))) & 3) | ((after[8 + j / 8] >> (j % 8)) & 1) << 2;
                uint8_t *chunk = dst + at + 4 * c + t;
                if (s < 6) {
                    chunk[64 * (s / 2)] |= (uint8_t)(code << (3 * (s % 2)));
                } else {
                    chunk[64 * (s - 6)] |= (uint8_t)((code & 3) << 6);
                    chunk[128] |= (uint8_t)((code >> 2) << s);
                }
            }
        return;
    }
    if (kind == GGML_Q8_0) {
        for (int s = 0; s < 8; s++) memcpy(dst + at + 64 * s + 4 * c, after + 4 * s, 4);
        return;
    }
    uint32_t qh = 0;
    if (five) memcpy(&qh, after, 4);
    const uint8_t *qs = after + (five ? 4 : 0);
    for (int u = 0; u < 4; u++) memcpy(dst + at + 64 * u + 4 * c, qs + 4 * u, 4);
    if (five)
        for (int s = 0; s < 8; s++)
            for (int t = 0; t < 4; t++) {
                const int bit = 4 * c + t;
                dst[at + 256 + 8 * s + bit / 8] |= (uint8_t)(((qh >> (4 * s + t)) & 1) << (bit % 8));
            }
}

typedef struct { const uint8_t *blocks; uint8_t *packed; int64_t N, K; int kind; } repack_job;

static void repack_range(const void *arg, int64_t begin, int64_t end)
{
    const repack_job *job = arg;
    const int64_t blocks = job->K / QK32, bytes = q32_block_bytes(job->kind), size = Q8G * bytes, row = blocks * bytes;
    for (int64_t g = begin; g < end; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *dst = job->packed + (g * blocks + b) * size;
            memset(dst, 0, (size_t)size);
            for (int c = 0; c < Q8G && Q8G * g + c < job->N; c++)
                pack_q32(job->blocks + (Q8G * g + c) * row + b * bytes, dst, c, job->kind);
        }
}

int q32_repack(const uint8_t *blocks, uint8_t *packed, int64_t N, int64_t K, int kind, int threads)
{
    if (K % QK32 || N < 0 || !ggml_is_q32(kind)) return -1;
    const repack_job job = {blocks, packed, N, K, kind};
    const int64_t groups = (N + Q8G - 1) / Q8G;
    parallel_for(repack_range, &job, groups, groups / 64 + 1, threads);
    return 0;
}
