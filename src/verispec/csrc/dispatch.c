/* The entry points that pick a kernel by CPU, ISA and weight format (baseline x86-64 code: it runs
 * before anything has checked what the CPU supports). */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"
#include "kernels.h"

_Static_assert(VS_MAX_GROUP == MAX_GROUP, "kernels.h and common.h agree on the group size");

int kernels_isa(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 256;
    return 0;
}

int kernels_vnni(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

int q8_amx = 0;

/* Whether this CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25) and the kernel lets this process
 * use the tiles' state (Linux asks for it once: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA). */
static int amx_usable(void)
{
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        usable = 0;
        if (kernels_vnni() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1))
            usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return usable;
}

int kernels_amx(int from_rows)
{
    q8_amx = from_rows > 0 && amx_usable() ? from_rows : 0;
    return q8_amx > 0;
}

/* One row of a matrix's last N % NR rows, one at a time with a tile's per-element arithmetic. */
static int linear_edge_row(const vs_product *p, int i, int64_t n, const float *x, float *const *y, int64_t M, int isa)
{
    const int64_t K = p->K, N = p->N[i];
    const float *b = p->b[i] ? p->b[i] + n : 0, *s = p->s[i] ? p->s[i] + n : 0;
    float *yn = y[i] + n;
    switch (p->format) {
    case VS_Q4K:
    case VS_Q6K: {  /* one exact k-quant row: widen it whole, then float32 */
        float *wide = malloc(sizeof(float) * (size_t)(K ? K : 1));
        if (!wide) return -1;
        if (p->format == VS_Q4K) widen_q4k((const uint8_t *)p->w[i] + n * (K / 2), p->s[i] + n * (K / 16), K, 1, 0, K, wide, 0);
        else widen_q6k((const int8_t *)p->w[i] + n * K, p->s[i] + n * (K / 16), K, 1, 0, K, wide, 0);
        (isa == 512 ? linear_edge_f32_512 : linear_edge_f32_256)(x, wide, s, b, yn, M, N, K);
        free(wide);
        return 0;
    }
    case VS_INT4:
        (isa == 512 ? linear_edge_i4_512 : linear_edge_i4_256)(x, (const uint8_t *)p->w[i] + n * (K / 2),
                                                               p->s[i] + n * (K / I4GROUP), b, yn, M, N, K);
        return 0;
    case VS_INT8:
        (isa == 512 ? linear_edge_i8_512 : linear_edge_i8_256)(x, (const int8_t *)p->w[i] + n * K, s, b, yn, M, N, K);
        return 0;
    case VS_BF16:
        (isa == 512 ? linear_edge_bf16_512 : linear_edge_bf16_256)(x, (const uint16_t *)p->w[i] + n * K, s, b, yn, M, N, K);
        return 0;
    default:
        (isa == 512 ? linear_edge_f32_512 : linear_edge_f32_256)(x, (const float *)p->w[i] + n * K, s, b, yn, M, N, K);
        return 0;
    }
}

/* A VS_GGUF_Q8 product: x rounded once (every row, on the calling thread) to what its matrices take, Q8_K
 * for the k-quant types and Q8_0 / Q8_1 for the 32-weight ones (a group may hold both: a Q4_K_M file's Q8_0
 * or Q5_0 matrices beside its Q4_K ones), then all the matrices' column groups as one job of the pool
 * (threads split groups; see kquant_q8.c, quant32_q8.c). The AVX-512 kernels need BW and VNNI; without
 * them the AVX2 ones run. */
static int gguf_q8_product(const vs_product *p, const float *x, float *const *y, int64_t M, int isa, int threads)
{
    static int vnni = -1;
    if (vnni < 0) vnni = kernels_vnni();
    const int wide = isa == 512 && vnni;
    const int64_t K = p->K;
    int kquant = 0, q32 = 0;
    for (int i = 0; i < p->count; i++) {
        if (ggml_is_q32(p->kind[i])) q32 = 1;
        else if (p->kind[i] == GGML_Q4_K || p->kind[i] == GGML_Q5_K || p->kind[i] == GGML_Q6_K) kquant = 1;
        else return -1;
    }
    if ((kquant && K % QK_K) || (q32 && K % QK32)) return -1;
    const int64_t M8 = q8_rows(M);  /* whole slabs of rows (see q8_at) */
    const size_t kbytes = kquant ? (size_t)(M8 * K + M8 * (K / QK_K) * 4 + M8 * (K / 16) * 2 + M8 * (K / 32) * 2) : 0;
    const size_t bytes32 = q32 ? (size_t)(M8 * K + M8 * (K / QK32) * (4 + 4 + 2)) : 0;
    const size_t kpadded = (kbytes + 63) / 64 * 64;
    int8_t *qx = aligned_alloc(64, kpadded + (bytes32 + 63) / 64 * 64 + 64);
    if (!qx) return -1;
    float *qd = (float *)(qx + M8 * K);
    int16_t *qb = (int16_t *)(qd + M8 * (K / QK_K)), *qb32 = qb + M8 * (K / 16);
    int8_t *qx0 = qx + kpadded;
    float *qd0 = (float *)(qx0 + M8 * K), *qs0 = qd0 + M8 * (K / QK32);
    int16_t *qa0 = (int16_t *)(qs0 + M8 * (K / QK32));
    if (kquant) (wide ? q8k_quantize_512 : q8k_quantize_256)(x, qx, qd, qb, qb32, M, K);
    if (q32) (wide ? q8_0_quantize_512 : q8_0_quantize_256)(x, qx0, qd0, qs0, qa0, M, K);
    q8_job jobs[MAX_GROUP];
    const void *job_ptrs[MAX_GROUP];
    int64_t columns[MAX_GROUP], work = 0;
    for (int i = 0; i < p->count; i++) {
        jobs[i] = (q8_job){.qx = qx, .qd = qd, .qb = qb, .qb32 = qb32, .w = p->w[i], .kind = p->kind[i], .b = p->b[i],
                           .y = y[i], .M = M, .N = p->N[i], .K = K, .qx0 = qx0, .qd0 = qd0, .qs0 = qs0, .qa0 = qa0};
        job_ptrs[i] = &jobs[i];
        columns[i] = (p->N[i] + Q8G - 1) / Q8G;  /* threads split groups of 16 columns (the repacked layout) */
        work += M * p->N[i] * K;
    }
    run_group(wide ? q8_range_512 : q8_range_256, job_ptrs, columns, p->count, work, threads);
    free(qx);
    return 0;
}

/* y[i] = x w[i]^T (+ b[i]) for the product's matrices (see vs_product), x [M, K], as one job of the
 * pool over all their weight tiles. Every output is bitwise what its matrix alone gives, whatever M. */
int linear_product(const vs_product *p, const float *x, float *const *y, int64_t M, int isa, int threads)
{
    const int count = p->count;
    const int64_t K = p->K;
    if (count < 1 || count > MAX_GROUP) return -1;
    const uint8_t *const *codes = (const uint8_t *const *)p->w;
    if (p->format == VS_INT4_VNNI) return linear_vnni_group(x, count, codes, p->s, p->b, y, p->N, M, K, threads) ? 0 : -1;
    if (p->format == VS_INT4_AVX2) return linear_q8avx2(x, count, codes, p->s, p->b, y, p->N, M, K, threads) ? 0 : -1;
    if (p->format == VS_PANELS) return panel_linear_group(x, count, p->w, p->b, y, p->N, M, K, threads);
    if (p->format == VS_GGUF_Q8) return gguf_q8_product(p, x, y, M, isa, threads);
    const range_fn ranges[2][VS_Q6K + 1] = {
        {[VS_F32] = linear_range_f32_256, [VS_BF16] = linear_range_bf16_256, [VS_INT8] = linear_range_i8_256,
         [VS_INT4] = linear_range_i4_256, [VS_Q4K] = linear_range_q4k_256, [VS_Q6K] = linear_range_q6k_256},
        {[VS_F32] = linear_range_f32_512, [VS_BF16] = linear_range_bf16_512, [VS_INT8] = linear_range_i8_512,
         [VS_INT4] = linear_range_i4_512, [VS_Q4K] = linear_range_q4k_512, [VS_Q6K] = linear_range_q6k_512}};
    if (p->format < 0 || p->format > VS_Q6K || !ranges[0][p->format]) return -1;
    linear_job jobs[MAX_GROUP];
    const void *job_ptrs[MAX_GROUP];
    int64_t tiles[MAX_GROUP], work = 0;
    for (int i = 0; i < count; i++) {
        jobs[i] = (linear_job){x, p->w[i], p->s[i], p->b[i], y[i], M, p->N[i], K};
        job_ptrs[i] = &jobs[i];
        tiles[i] = p->N[i] / NR;
        work += M * p->N[i] * K;
    }
    run_group(ranges[isa == 512][p->format], job_ptrs, tiles, count, work, threads);
    for (int i = 0; i < count; i++)
        for (int64_t n = tiles[i] * NR; n < p->N[i]; n++)
            if (linear_edge_row(p, i, n, x, y, M, isa)) return -1;
    return 0;
}

/* Int4Matrix.quantize: rows of w [N, K] (K a multiple of 64) to codes packed [N, K / 2] and scales
 * [N, K / 64], of `count` candidate shrinks (at most I4MAXSHRINKS); see int4_quantize_rows in int4.c. */
int int4_quantize(const float *w, uint8_t *packed, float *scale, const float *shrinks, int64_t N, int64_t K, int count,
                  int isa, int threads)
{
    if (count < 1 || count > I4MAXSHRINKS) return -1;
    const quantize_job job = {w, packed, scale, shrinks, K, count};
    parallel_for(isa == 512 ? int4_quantize_rows_512 : int4_quantize_rows_256, &job, N, 16, threads);
    return 0;
}

void silu_mul(float *gate, const float *up, int64_t n, int isa)
{
    if (isa == 512) silu_mul_isa_512(gate, up, n); else silu_mul_isa_256(gate, up, n);
}

void rms_norm(float *x, const float *delta, const float *w, float *out, int64_t M, int64_t D, float eps, int isa)
{
    if (isa == 512) rms_norm_isa_512(x, delta, w, out, M, D, eps); else rms_norm_isa_256(x, delta, w, out, M, D, eps);
}
