/* The library's entry points, the only symbols it exports. Python binds them in one place
 * (verispec/models/kernels/abi.py), with a ctypes mirror of each struct below: change a struct here
 * and there together. `isa` is 512 (AVX-512) or 256 (AVX2+FMA), what kernels_isa() allows; `threads`
 * how many threads of the pool (pool.c) a call may use. Calls returning int give 0, or -1 when
 * scratch memory ran out or an argument is out of range. */
#ifndef VS_KERNELS_H
#define VS_KERNELS_H

#include <stdint.h>

#include "formats.h"

#define VS_API __attribute__((visibility("default")))
#define VS_MAX_GROUP 4  /* matrices per product (MAX_GROUP) */

/* One product: `count` matrices of one format (enum vs_format) and width K applied to the same x,
 * y[i] = x w[i]^T (+ b[i]); w[i] [N[i], K] in the format's layout, s[i] its scales (or NULL),
 * b[i] a bias (or NULL). Kept by Python for every call of a layer's product. */
typedef struct {
    int count, format;
    int64_t K;
    const void *w[VS_MAX_GROUP];
    const float *s[VS_MAX_GROUP], *b[VS_MAX_GROUP];
    int64_t N[VS_MAX_GROUP];
    int kind[VS_MAX_GROUP];  /* VS_GGUF_Q8 only: each matrix's ggml block type */
} vs_product;

/* A decoder layer: its two RMSNorm weights and its four products. */
typedef struct {
    const float *attn_norm, *mlp_norm;
    vs_product qkv, o, gate_up, down;
} vs_layer;

/* Slot attention of T new tokens per batch row (see attention.c): q, out [B, T, H, D]; keys
 * kc [B, KVH, cap / 16, D, 16]; values vc [B, KVH, cap, D]; vis [B, vis_stride] (1: slot visible);
 * tree [B, T, T] or NULL; the new tokens at slots start .. start + T - 1; scores scaled by `scale`. */
typedef struct {
    const float *q, *kc, *vc;
    const uint8_t *vis, *tree;
    float *out;
    int64_t B, T, H, KVH, D, cap, vis_stride, start;
    float scale;
} vs_attention;

/* Every decoder layer of a small pass (see decoder_layers in layer.c). */
enum { VS_NORMED, VS_DELTA, VS_Q, VS_K, VS_V, VS_ATTENDED, VS_GATE, VS_UP, VS_BUFFERS };
typedef struct {
    const vs_layer *layers;
    int64_t count;
    float *x;                          /* [B * T, hidden], the residual stream, updated in place */
    float *buffers[VS_BUFFERS];        /* each [B * T, its width], contiguous */
    int64_t B, T, hidden, H, KVH, D;
    const int64_t *positions;          /* [B * T] */
    const float *cos_table, *sin_table;  /* [positions, D] */
    float *kc, *vc;                    /* layer l's keys at kc + l * kc_stride, values at vc + l * vc_stride */
    int64_t kc_stride, vc_stride, cap;
    const uint8_t *vis, *tree;
    int64_t vis_stride, start;
    float scale, eps;
    int32_t keys_only_last;            /* 1: the last layer stops once its keys and values are stored (a prompt's read) */
} vs_decoder;

/* Prefill's blocked GEMM (blocked.c): y[i] = x w[i]^T (+ b[i]) for count matrices sharing x [M, K];
 * kind[i] from enum vs_blocked_kind; xp scratch of ceil(M / 6) * 6 * K floats. */
typedef struct {
    int count;
    int64_t M, K;
    const float *x;
    float *xp;
    const void *w[VS_MAX_GROUP];
    const float *s[VS_MAX_GROUP], *b[VS_MAX_GROUP];
    float *y[VS_MAX_GROUP];
    int64_t N[VS_MAX_GROUP];
    int kind[VS_MAX_GROUP];
} vs_blocked;

VS_API int kernels_isa(void);   /* the widest ISA this CPU runs: 512, 256, or 0 (none: do not call the rest) */
VS_API int kernels_vnni(void);  /* 1 when the CPU has AVX-512 VNNI (for VS_INT4_VNNI) */
/* Whether Q4_K passes of VS_GGUF_Q8 products of at least `from_rows` rows run on AMX tiles (kquant_amx.c, bitwise
 * the VNNI kernel's); 0 turns them off. They run where the CPU has AMX-INT8 and the kernel grants the tiles' state.
 * Returns 1 when they are in use from now on, else 0. */
VS_API int kernels_amx(int from_rows);
VS_API int linear_product(const vs_product *product, const float *x, float *const *y, int64_t M, int isa, int threads);
VS_API void blocked_linear(const vs_blocked *args, int threads);
/* kquant_q8_pack.c: a GGUF Q4_K / Q5_K / Q6_K matrix [N, K] (kind 12 / 13 / 14) repacked for VS_GGUF_Q8 products
 * into packed [ceil(N / 16) * K / 256 * (2368, 2880 or 3360 bytes)], or a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 one
 * (kind 2 / 3 / 6 / 7 / 8) into [ceil(N / 16) * K / 32 * 16 * (18, 20, 22, 24 or 34 bytes)] (quant32_q8_pack.c);
 * -1 for another kind, or K not a multiple of the block (256, 32) */
VS_API int gguf_q8_repack(const uint8_t *blocks, uint8_t *packed, int64_t N, int64_t K, int kind, int threads);
/* Rows ids[0..n) of an [N, K] Q4_K / Q5_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrix (`kind`, its blocks as the file stores them) ->
 * out [n, K] float32, as ggml's dequantize_row_*: 0, or 1 (bad kind or K), 2 (an id out of range). */
VS_API int gguf_dequantize_rows(const uint8_t *blocks, const int64_t *ids, int64_t n, int64_t N, int64_t K, int kind, float *out);
VS_API int64_t exact_blocks_mismatch(const void *w, const float *s, const float *dense, int64_t N, int64_t K, int format);
VS_API int int4_quantize(const float *w, uint8_t *packed, float *scale, const float *shrinks, int64_t N, int64_t K,
                         int count, int isa, int threads);
VS_API void silu_mul(float *gate, const float *up, int64_t n, int isa);
VS_API void rms_norm(float *x, const float *delta, const float *w, float *out, int64_t M, int64_t D, float eps, int isa);
VS_API void rope(float *x, int64_t M, int64_t ld, int64_t heads, int64_t D, const int64_t *positions,
                 const float *cos_table, const float *sin_table);
VS_API void cache_write(const float *k, const float *v, float *kc, float *vc, int64_t B, int64_t T, int64_t KVH,
                        int64_t D, int64_t cap, int64_t start);
VS_API int slot_attention(const vs_attention *args, int isa, int threads);
VS_API int decoder_layers(const vs_decoder *args, int isa, int threads);

#endif
