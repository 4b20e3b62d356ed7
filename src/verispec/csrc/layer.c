/* ======== a decoder layer: the pieces between its products, and all its calls as one ========
 * (baseline x86-64 code: it calls the kernels of the ISA it is given) */
#include "common.h"
#include "kernels.h"

/* Rotary embedding (Su et al. 2021), half-split layout as in transformers, in place on x [M, heads * D]
 * (row stride ld): x*cos + rotate_half(x)*sin with cos/sin rows picked by position. Elementwise,
 * rounded exactly as transformers' mul/neg/mul/add sequence. */
void rope(float *x, int64_t M, int64_t ld, int64_t heads, int64_t D, const int64_t *positions,
          const float *cos_table, const float *sin_table)
{
    const int64_t half = D / 2;
    for (int64_t m = 0; m < M; m++) {
        const float *c = cos_table + positions[m] * D, *s = sin_table + positions[m] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + m * ld + h * D;
            for (int64_t d = 0; d < half; d++) {
                const float a = v[d], b = v[d + half];
                v[d] = a * c[d] + (-b) * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}

/* New keys k [B, T, KVH, D] -> kc [B, KVH, cap/16, D, 16] at slots start..start+T-1 (16-slot
 * blocks, d-major inside, for attention's slot-parallel scores); values v [B, T, KVH, D] ->
 * vc [B, KVH, cap, D]. */
void cache_write(const float *k, const float *v, float *kc, float *vc, int64_t B, int64_t T, int64_t KVH,
                 int64_t D, int64_t cap, int64_t start)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t s = start + t;
                const float *ks = k + ((b * T + t) * KVH + h) * D, *vs = v + ((b * T + t) * KVH + h) * D;
                float *kd = kc + (b * KVH + h) * D * cap + (s / SLOT_BLOCK) * D * SLOT_BLOCK + s % SLOT_BLOCK;
                float *vd = vc + ((b * KVH + h) * cap + s) * D;
                for (int64_t d = 0; d < D; d++) { kd[d * SLOT_BLOCK] = ks[d]; vd[d] = vs[d]; }
            }
}

/* Threads split the (batch row, kv head) pairs; see attention.c for what each computes. */
int slot_attention(const vs_attention *a, int isa, int threads)
{
    attention_job job = {a->q, a->kc, a->vc, a->vis, a->tree, a->out, a->B, a->T, a->H, a->KVH, a->D, a->cap,
                         a->vis_stride, a->start, a->scale, 0};
    const int small = a->T * (a->start + a->T) * a->H * a->D < 65536;
    parallel_for(isa == 512 ? attention_range_512 : attention_range_256, &job, a->B * a->KVH, 1, small ? 1 : threads);
    return job.failed ? -1 : 0;
}

/* Every decoder layer of a small pass as one call: the calls a Python loop over the layers would make
 * (RMSNorm, q/k/v, RoPE, cache write, slot attention, o, RMSNorm, gate/up, SwiGLU, down), in the same
 * order on the same buffers, so bitwise the same numbers, without ~10 Python-to-C crossings per layer
 * and with the thread pool kept busy from one product to the next (see vs_decoder).
 * x [M = B * T, hidden]: the residual stream, updated in place; buffers (each [M, width], contiguous):
 * normed, delta, q, k, v, attended, gate, up. On return delta holds the last layer's MLP output, not yet
 * added to x (the final norm adds it); with keys_only_last, the last layer stops after storing its keys and
 * values, and x and delta hold nothing anyone should read. Layer l's keys are at kc + l * kc_stride
 * ([B, KVH, cap/16, D, 16]), its values at vc + l * vc_stride ([B, KVH, cap, D]). Returns 0, or -1 if scratch
 * memory ran out. */
int decoder_layers(const vs_decoder *d, int isa, int threads)
{
    const int64_t B = d->B, T = d->T, M = B * T, H = d->H, KVH = d->KVH, D = d->D;
    float *x = d->x, *normed = d->buffers[VS_NORMED], *delta = d->buffers[VS_DELTA];
    float *q = d->buffers[VS_Q], *k = d->buffers[VS_K], *v = d->buffers[VS_V];
    float *gate = d->buffers[VS_GATE], *up = d->buffers[VS_UP];
    float *const qkv[3] = {q, k, v}, *const gate_up[2] = {gate, up};
    vs_attention attention = {q, 0, 0, d->vis, d->tree, d->buffers[VS_ATTENDED], B, T, H, KVH, D, d->cap,
                              d->vis_stride, d->start, d->scale};
    for (int64_t l = 0; l < d->count; l++) {
        const vs_layer *layer = d->layers + l;
        float *keys = d->kc + l * d->kc_stride, *values = d->vc + l * d->vc_stride;
        rms_norm(x, l ? delta : 0, layer->attn_norm, normed, M, d->hidden, d->eps, isa);  /* x += the last MLP output first */
        if (linear_product(&layer->qkv, normed, qkv, M, isa, threads)) return -1;
        rope(q, M, H * D, H, D, d->positions, d->cos_table, d->sin_table);
        rope(k, M, KVH * D, KVH, D, d->positions, d->cos_table, d->sin_table);
        cache_write(k, v, keys, values, B, T, KVH, D, d->cap, d->start);
        if (d->keys_only_last && l == d->count - 1) break;  /* nothing reads this layer's output */
        attention.kc = keys;
        attention.vc = values;
        if (slot_attention(&attention, isa, threads)) return -1;
        if (linear_product(&layer->o, d->buffers[VS_ATTENDED], &delta, M, isa, threads)) return -1;
        rms_norm(x, delta, layer->mlp_norm, normed, M, d->hidden, d->eps, isa);
        if (linear_product(&layer->gate_up, normed, gate_up, M, isa, threads)) return -1;
        silu_mul(gate, up, M * layer->gate_up.N[0], isa);
        if (linear_product(&layer->down, gate, &delta, M, isa, threads)) return -1;
    }
    return 0;
}
