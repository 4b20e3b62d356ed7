"""A float32 linear layer for a few rows at a time, fast at small batch and exact row by row.

Decoding and verifying multiply a handful of activation rows (1 to ~16) by every weight matrix, so
the cost is reading the weights from memory, not arithmetic. PyTorch's CPU GEMMs (MKL, oneDNN) are
tuned for big batches: on a 2-core AVX-512 VM an 8-row product costs 3-5x a 1-row product although
both read the same bytes. Worse for speculative decoding, they pick different code paths for
different row counts, so row 0 of an 8-row product need not equal the same row computed alone.

`rowwise_linear` computes y[m, n] = x[m] . w[n] (+ b[n]) with the weight read once per tile of up
to 6 rows, and every output element accumulated by the same sequence of fused multiply-adds
(16 or 8 lanes along k, in order, then a fixed horizontal sum) whatever the number of rows and
wherever the row falls in a tile. A row's result is therefore bitwise independent of its batch
mates: a width-k verify pass sees exactly the numbers of k single-token passes.

The kernel is C with AVX-512 and AVX2/FMA variants (chosen by what the CPU supports), compiled
once with the system C compiler into the verispec cache and called through ctypes; threads come
from the OpenMP runtime that PyTorch itself loaded, so `torch.set_num_threads` governs it. Without
a compiler or a suitable CPU, `available()` is False and callers use `torch.nn.functional.linear`.
This module knows nothing about models: it multiplies matrices.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Rows one call is meant for. Above this, MKL's blocked GEMM (prefill) is faster, and exactness
# across widths no longer matters: the engine never compares a prefill row with a decode row.
MAX_ROWS = 32

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]). x [M, K], w [N, K], y [M, N], all row-major, contiguous.
 *
 * Exactness: every y[m, n] has its own accumulator vector, fed x[m, k:k+L] * w[n, k:k+L] by one
 * fused multiply-add per L lanes in increasing k (a zero-filled masked tail last), then reduced by a
 * fixed shuffle sequence. The tile shape (how many rows share a pass over the weights) changes only
 * which accumulators are live together, never the arithmetic one of them sees.
 * Build with -ffp-contract=off so the compiler does not fuse the scalar bias add differently. */

#define NR 4  /* weight rows per tile */

/* ---------------- AVX-512: 16 lanes, up to 6 x 4 accumulators (24 of 32 zmm registers) ------ */

#define TILE512(MR)                                                                              \
__attribute__((target("avx512f"))) static void tile512_##MR(                                     \
    const float *x, const float *w, const float *b, float *y, int64_t K, int64_t N)              \
{                                                                                                \
    __m512 acc[MR][NR];                                                                          \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                        \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();   \
    const int64_t kfull = K & ~(int64_t)15;                                                      \
    for (int64_t k = 0; k < kfull; k += 16) {                                                    \
        __m512 wv[NR];                                                                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_ps(w + j * K + k); \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                  \
            __m512 xv = _mm512_loadu_ps(x + i * K + k);                                          \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                \
                acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);                               \
        }                                                                                        \
    }                                                                                            \
    if (K > kfull) {                                                                             \
        const __mmask16 tail = (__mmask16)((1u << (K - kfull)) - 1u);                            \
        __m512 wv[NR];                                                                           \
        for (int j = 0; j < NR; j++) wv[j] = _mm512_maskz_loadu_ps(tail, w + j * K + kfull);     \
        for (int i = 0; i < MR; i++) {                                                           \
            __m512 xv = _mm512_maskz_loadu_ps(tail, x + i * K + kfull);                          \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);     \
        }                                                                                        \
    }                                                                                            \
    for (int i = 0; i < MR; i++)                                                                 \
        for (int j = 0; j < NR; j++)                                                             \
            y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]) + (b ? b[j] : 0.0f);                 \
}

TILE512(1) TILE512(2) TILE512(3) TILE512(4) TILE512(5) TILE512(6)

/* One weight row against MR activation rows: the same per-element arithmetic as the tiles above,
 * for the last N % 4 weight rows. */
__attribute__((target("avx512f"))) static void edge512(
    const float *x, const float *w, const float *b, float *y, int64_t K, int64_t N, int mr)
{
    const int64_t kfull = K & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (K - kfull)) - 1u);
    for (int i = 0; i < mr; i++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < kfull; k += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * K + k), _mm512_loadu_ps(w + k), acc);
        if (K > kfull)
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + i * K + kfull), _mm512_maskz_loadu_ps(tail, w + kfull), acc);
        y[i * N] = _mm512_reduce_add_ps(acc) + (b ? b[0] : 0.0f);
    }
}

typedef void (*tile_fn)(const float *, const float *, const float *, float *, int64_t, int64_t);
static const tile_fn tiles512[7] = {0, tile512_1, tile512_2, tile512_3, tile512_4, tile512_5, tile512_6};

/* ---------------- AVX2 + FMA: 8 lanes, up to 3 x 4 accumulators (12 of 16 ymm registers) ------ */

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) static inline __m256i tailmask256(int64_t rem)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#define TILE256(MR)                                                                              \
__attribute__((target("avx2,fma"))) static void tile256_##MR(                                    \
    const float *x, const float *w, const float *b, float *y, int64_t K, int64_t N)              \
{                                                                                                \
    __m256 acc[MR][NR];                                                                          \
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++)                                        \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();   \
    const int64_t kfull = K & ~(int64_t)7;                                                       \
    for (int64_t k = 0; k < kfull; k += 8) {                                                     \
        __m256 wv[NR];                                                                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(w + j * K + k); \
        _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++) {                                  \
            __m256 xv = _mm256_loadu_ps(x + i * K + k);                                          \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                \
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);                               \
        }                                                                                        \
    }                                                                                            \
    if (K > kfull) {                                                                             \
        const __m256i tail = tailmask256(K - kfull);                                             \
        __m256 wv[NR];                                                                           \
        for (int j = 0; j < NR; j++) wv[j] = _mm256_maskload_ps(w + j * K + kfull, tail);        \
        for (int i = 0; i < MR; i++) {                                                           \
            __m256 xv = _mm256_maskload_ps(x + i * K + kfull, tail);                             \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);     \
        }                                                                                        \
    }                                                                                            \
    for (int i = 0; i < MR; i++)                                                                 \
        for (int j = 0; j < NR; j++)                                                             \
            y[i * N + j] = hsum256(acc[i][j]) + (b ? b[j] : 0.0f);                               \
}

TILE256(1) TILE256(2) TILE256(3)

__attribute__((target("avx2,fma"))) static void edge256(
    const float *x, const float *w, const float *b, float *y, int64_t K, int64_t N, int mr)
{
    const int64_t kfull = K & ~(int64_t)7;
    const __m256i tail = tailmask256(K - kfull);
    for (int i = 0; i < mr; i++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < kfull; k += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k), _mm256_loadu_ps(w + k), acc);
        if (K > kfull)
            acc = _mm256_fmadd_ps(_mm256_maskload_ps(x + i * K + kfull, tail), _mm256_maskload_ps(w + kfull, tail), acc);
        y[i * N] = hsum256(acc) + (b ? b[0] : 0.0f);
    }
}

static const tile_fn tiles256[4] = {0, tile256_1, tile256_2, tile256_3};

/* ---------------- driver ---------------- */

int rowwise_isa(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 256;
    return 0;
}

/* isa: 512 or 256 (must be supported). Threads split the weight rows: each weight byte is read by
 * one thread, once per group of up to MR activation rows. */
void rowwise_linear(const float *x, const float *w, const float *b, float *y,
                    int64_t M, int64_t N, int64_t K, int isa)
{
    const tile_fn *tiles = isa == 512 ? tiles512 : tiles256;
    const int max_mr = isa == 512 ? 6 : 3;
    const int64_t ntiles = N / NR;
    /* Below ~64k multiply-adds a fork/join costs more than it saves. */
    #pragma omp parallel for schedule(static) if (M * N * K > 65536)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t n0 = t * NR;
        for (int64_t m0 = 0; m0 < M;) {
            /* Split rows evenly over the fewest passes: 8 rows -> 4 + 4 rather than 6 + 2. */
            const int64_t passes = (M - m0 + max_mr - 1) / max_mr;
            const int mr = (int)((M - m0 + passes - 1) / passes);
            tiles[mr](x + m0 * K, w + n0 * K, b ? b + n0 : 0, y + m0 * N + n0, K, N);
            m0 += mr;
        }
    }
    for (int64_t n = ntiles * NR; n < N; n++) {
        if (isa == 512) edge512(x, w + n * K, b ? b + n : 0, y + n, K, N, (int)M);
        else edge256(x, w + n * K, b ? b + n : 0, y + n, K, N, (int)M);
    }
}
"""


# Attention of a few new tokens over the slot cache, one template instantiated per vector ISA.
# VEC/LOAD/FMA/... are replaced textually; see _instantiate.
_ATTENTION_TEMPLATE = r"""
/* Scaled dot-product attention of T new queries per batch row against the cache's visible slots.
 * q [B, T, H, D] and out [B, T, H, D] contiguous; kc/vc point at a layer's cache laid out
 * [B, capacity, KVH, D]; vis [B, vis_stride] (1 = visible) covers slots 0 .. start+T-1, the new
 * tokens sitting at slots start .. start+T-1. Query t of row b sees slot s iff s <= start+t and
 * vis[b, s]: causal, holes and left padding skipped outright.
 *
 * Exactness: invisible slots are skipped, not masked with -inf, so a query's result depends only on
 * the visible keys in slot order: the same with or without holes, batch mates, or later tokens of
 * the same pass. A query with no visible slot (padding) gets zeros, never NaN. */
__attribute__((target(ISA_TARGET))) static void attend_one_SUFFIX(
    const float *q, const float *kc, const float *vc, const uint8_t *vis, float *out,
    int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t kvh, int64_t start, float scale,
    float *scores, float *acc)
{
    const int64_t G = H / KVH, S = start + T, Q = T * G, slot = KVH * D;
    /* 1. scores[i, s] = q_i . k_s * scale; each key read once for the G*T queries that share it */
    for (int64_t s = 0; s < S; s++) {
        if (!vis[s]) continue;
        const float *k = kc + s * slot + kvh * D;
        const int64_t first_t = s > start ? s - start : 0;
        for (int64_t t = first_t; t < T; t++)
            for (int64_t g = 0; g < G; g++) {
                const float *qv = q + (t * H + kvh * G + g) * D;
                VEC a = ZERO();
                for (int64_t d = 0; d < D; d += LANES) a = FMA(LOAD(qv + d), LOAD(k + d), a);
                scores[(t * G + g) * S + s] = HSUM(a) * scale;
            }
    }
    /* 2. softmax over each query's visible slots, summed in slot order */
    for (int64_t i = 0; i < Q; i++) {
        const int64_t last = start + i / G;  /* the query's own slot */
        float *row = scores + i * S, top = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s <= last; s++) if (vis[s] && row[s] > top) top = row[s];
        for (int64_t s = 0; s <= last; s++) if (vis[s]) { row[s] = expf(row[s] - top); total += row[s]; }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t s = 0; s <= last; s++) if (vis[s]) row[s] *= inv;
        for (int64_t d = 0; d < D; d++) acc[i * D + d] = 0.0f;
    }
    /* 3. out_i = sum_s p_i[s] v_s, in slot order; each value vector read once */
    for (int64_t s = 0; s < S; s++) {
        if (!vis[s]) continue;
        const float *v = vc + s * slot + kvh * D;
        const int64_t first_i = (s > start ? s - start : 0) * G;
        for (int64_t i = first_i; i < Q; i++) {
            const VEC p = SET1(scores[i * S + s]);
            for (int64_t d = 0; d < D; d += LANES) STORE(acc + i * D + d, FMA(p, LOAD(v + d), LOAD(acc + i * D + d)));
        }
    }
    for (int64_t i = 0; i < Q; i++) {
        const int64_t t = i / G, g = i % G;
        float *o = out + (t * H + kvh * G + g) * D;
        for (int64_t d = 0; d < D; d++) o[d] = acc[i * D + d];
    }
}
"""

_ISAS = {
    "512": {"ISA_TARGET": '"avx512f"', "SUFFIX": "512", "VEC": "__m512", "LANES": "16", "ZERO": "_mm512_setzero_ps",
            "FMA": "_mm512_fmadd_ps", "LOAD": "_mm512_loadu_ps", "STORE": "_mm512_storeu_ps", "SET1": "_mm512_set1_ps",
            "HSUM": "_mm512_reduce_add_ps"},
    "256": {"ISA_TARGET": '"avx2,fma"', "SUFFIX": "256", "VEC": "__m256", "LANES": "8", "ZERO": "_mm256_setzero_ps",
            "FMA": "_mm256_fmadd_ps", "LOAD": "_mm256_loadu_ps", "STORE": "_mm256_storeu_ps", "SET1": "_mm256_set1_ps",
            "HSUM": "hsum256"},
}


def _instantiate(template: str, isa: str) -> str:
    for placeholder, text in _ISAS[isa].items():
        template = template.replace(placeholder, text)
    return template


_ATTENTION_DRIVER = r"""
/* Returns 0, or -1 when scratch memory ran out. Threads split the (batch row, kv head) pairs. */
int slot_attention(const float *q, const float *kc, const float *vc, const uint8_t *vis, float *out,
                   int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                   int64_t cache_row_stride, int64_t vis_stride, int64_t start, float scale, int isa)
{
    const int64_t G = H / KVH, S = start + T;
    int failed = 0;
    #pragma omp parallel for schedule(static) if (B * KVH > 1 && T * S * H * D > 65536)
    for (int64_t job = 0; job < B * KVH; job++) {
        const int64_t b = job / KVH, kvh = job % KVH;
        float *scores = malloc(sizeof(float) * (size_t)(T * G) * (size_t)(S + D));
        if (!scores) { failed = 1; continue; }
        float *acc = scores + T * G * S;
        const float *qb = q + b * T * H * D;
        float *ob = out + b * T * H * D;
        if (isa == 512)
            attend_one_512(qb, kc + b * cache_row_stride, vc + b * cache_row_stride, vis + b * vis_stride, ob,
                           T, H, KVH, D, kvh, start, scale, scores, acc);
        else
            attend_one_256(qb, kc + b * cache_row_stride, vc + b * cache_row_stride, vis + b * vis_stride, ob,
                           T, H, KVH, D, kvh, start, scale, scores, acc);
        free(scores);
    }
    return failed ? -1 : 0;
}
"""

_SOURCE += _instantiate(_ATTENTION_TEMPLATE, "512") + _instantiate(_ATTENTION_TEMPLATE, "256") + _ATTENTION_DRIVER

_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off"]
_LIBS = ["-lm"]

_library: ctypes.CDLL | None = None
_isa = 0
_tried = False


def _cache_dir() -> Path:
    configured = os.environ.get("VERISPEC_HOME")
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "verispec"
    return root / "kernels"


def _build() -> Path:
    """Compile _SOURCE once per source text; the file name carries its hash, so edits rebuild."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) on PATH")
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"rowwise_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "rowwise.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built), *_LIBS], check=True, capture_output=True, text=True)
        os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
    return target


def _load() -> None:
    global _library, _isa, _tried
    if _tried:
        return
    _tried = True
    if os.environ.get("VERISPEC_NO_KERNELS"):
        return
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("verispec: rowwise kernel unavailable, using torch.nn.functional.linear (%s)", detail.strip()[:300])
        return
    library.rowwise_isa.restype = ctypes.c_int
    library.rowwise_linear.restype = None
    library.rowwise_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.slot_attention.restype = ctypes.c_int
    library.slot_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int]
    isa = library.rowwise_isa()
    wanted = os.environ.get("VERISPEC_KERNEL_ISA")  # "256" forces the AVX2 path (tests, comparisons)
    if wanted and int(wanted) <= isa:
        isa = int(wanted)
    _library, _isa = (library, isa) if isa else (None, 0)


def available() -> bool:
    """Whether `rowwise_linear` runs here (compiler present, CPU with AVX2+FMA or AVX-512)."""
    _load()
    return _library is not None


def isa() -> int:
    """Vector width in bits the kernel uses: 512, 256, or 0 when unavailable."""
    _load()
    return _isa


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N], float32 CPU tensors.

    Each output row depends on its input row only, bitwise. Raises RuntimeError when unavailable;
    check `available()` first.
    """
    if not available():
        raise RuntimeError("rowwise kernel unavailable: use torch.nn.functional.linear")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError("rowwise_linear takes float32 CPU tensors")
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, {k}] matrix, got {tuple(weight.shape)}")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if out is None:
        out = torch.empty(rows, n, dtype=torch.float32)
    _library.rowwise_linear(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                            out.data_ptr(), rows, n, k, _isa)
    return out


def attention_supported(head_dim: int) -> bool:
    """Whether `slot_attention` handles this head size (a whole number of vector lanes)."""
    return available() and head_dim % (16 if _isa == 512 else 8) == 0


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                   start: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of T new tokens per row over the visible slots of a cache.

    q [B, T, H, D] float32 (contiguous); k_cache, v_cache [B, capacity, KVH, D] with the new tokens'
    keys/values already at slots start .. start+T-1 (rows may be strided, each row contiguous);
    visible [B, >= start+T] bool. Query t of row b attends to slots s <= start+t with visible[b, s]
    (a query that sees nothing, i.e. padding, gets zeros). Returns [B, T, H, D].
    """
    if not attention_supported(q.shape[-1]):
        raise RuntimeError("slot_attention unavailable for this head size: use scaled_dot_product_attention")
    batch, width, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    for cache in (k_cache, v_cache):
        if cache.dtype != torch.float32 or cache[0].stride() != (kv_heads * head_dim, head_dim, 1):
            raise ValueError("k_cache/v_cache must be float32 [B, capacity, KVH, D] with contiguous rows")
    if k_cache.stride(0) != v_cache.stride(0) or visible.stride(-1) != 1 or visible.dtype != torch.bool:
        raise ValueError("k_cache and v_cache must share a layout; visible must be a bool matrix with unit column stride")
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    status = _library.slot_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), visible.data_ptr(), out.data_ptr(),
                                     batch, width, heads, kv_heads, head_dim, k_cache.stride(0), visible.stride(0),
                                     start, scale, _isa)
    if status:
        raise MemoryError("slot_attention could not allocate its score buffer")
    return out
