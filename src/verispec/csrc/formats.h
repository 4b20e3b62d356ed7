/* Weight formats of a linear product: the one list that C and Python share.
 * Python (verispec.models.kernels.abi) reads the enumerators below from this file at import, so
 * keep one `VS_NAME = number,` per line. */
#ifndef VS_FORMATS_H
#define VS_FORMATS_H

enum vs_format {
    VS_F32 = 0,        /* float32 [N, K] */
    VS_BF16 = 1,       /* bfloat16 [N, K] (stored as uint16; converted exactly, accumulated in float32) */
    VS_INT8 = 2,       /* int8 [N, K], a float32 scale per row in s (accumulated in float32, scaled once at the end) */
    VS_INT4 = 3,       /* int4 codes [N, K / 2] in groups of I4GROUP along k, a float32 scale per group in s [N, K / I4GROUP] */
    VS_INT4_VNNI = 4,  /* the same int4 matrices, activations rounded to int8 per group (AVX-512 VNNI) */
    VS_INT4_AVX2 = 5,  /* the same on AVX2 (byte products through vpmaddubsw) */
    VS_Q4K = 6,        /* exact Q4_K blocks (see widen_q4k; s holds their scales and mins) */
    VS_Q6K = 7,        /* exact Q6_K blocks (see widen_q6k; s holds their scales) */
    VS_PANELS = 8,     /* float32 in 16-row panels (see panel_linear_group; AVX2+FMA whatever the ISA) */
    VS_GGUF_Q8 = 9,    /* a GGUF file's quantized blocks, repacked 16 columns interleaved (kquant_q8_pack.c, quant32_q8_pack.c),
                          vs_product.kind[i] the ggml type of matrix i (12 Q4_K, 13 Q5_K, 14 Q6_K; 2 Q4_0, 3 Q4_1, 6 Q5_0,
                          7 Q5_1, 8 Q8_0); activations rounded per row as ggml's Q8_K (k-quants) or Q8_0 / Q8_1 (the
                          32-weight types): llama.cpp's numerics (kquant_q8.c, quant32_q8.c) */
};

/* How blocked_linear_group (prefill) reads one matrix of its group. */
enum vs_blocked_kind {
    VS_BLOCKED_F32 = 0,     /* float32 [N, K], packed into panels as it streams */
    VS_BLOCKED_INT4 = 1,    /* the VS_INT4 layout, widened to float32 as its panels are packed */
    VS_BLOCKED_PANELS = 2,  /* float32 already in the GEMM's panels, [ceil(N / 16)][K][16] (VS_PANELS): read in place */
};

#endif
