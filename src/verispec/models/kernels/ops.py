"""The operations a native model's pass is made of, on the C kernels: linear products (`Linear`,
`LinearGroup`, `rowwise_linear`; `blocked_linear` for prefill), `rms_norm`, `rope_`, `silu_mul_`,
`cache_write`, `slot_attention`, and every decoder layer at once (`LayerStack`). Each checks its
tensors, fills the C call's struct (abi.py) and calls the library of `runtime()`."""

from __future__ import annotations

import ctypes

import torch

from verispec.models.kernels import abi
from verispec.models.kernels.abi import Format
from verispec.models.kernels.matrices import (ExactBlocks, GGUFMatrix, Int4Matrix, Int8Matrix, PanelMatrix,
                                              QuantizedMatrix)
from verispec.models.kernels.runtime import check, isa, runtime
from verispec.models.kernels.threads import threads

# Rows one small pass may hold. Above this (prefill), a blocked GEMM is faster, and exactness
# across widths no longer matters: the engine never compares a prefill row with a decode row.
MAX_ROWS = 32
# Rows one pass of a model with llama.cpp's numerics (numerics="q8") may hold: its kernels give every row the same
# numbers at any width, so its prompt is read in passes this wide. On AMX tiles a Q4_K or Q6_K product gains with the
# width (csrc/kquant_amx.c); the VNNI and AVX2 tiles stream a column group once per pass and re-read it from cache
# for each further 8 rows, so a wider pass costs them nothing (bench/README.md).
Q8_MAX_ROWS = 128


def _check_masks(visible: torch.Tensor, tree: torch.Tensor | None, batch: int, width: int) -> None:
    """The attention masks the C kernels read: visible [batch, >= slots] bool with unit column stride, tree
    (or None) [batch, width, width] contiguous bool."""
    if visible.dtype != torch.bool or visible.stride(-1) != 1:
        raise ValueError("visible must be a bool matrix with unit column stride")
    if tree is not None and (tree.dtype != torch.bool or tuple(tree.shape) != (batch, width, width) or not tree.is_contiguous()):
        raise ValueError(f"tree must be a contiguous bool tensor [{batch}, {width}, {width}]")


def _int4_code() -> int:
    """The format int4 matrices run as now: INT4 (unpack nibbles to float), INT4_VNNI (int8 activations,
    AVX-512 VNNI) or INT4_AVX2 (int8 activations, AVX2 byte products); see `config.KernelConfig`."""
    return runtime().int4_format


def blocked_preferred() -> bool:
    """Whether big float32 passes (prefill) should multiply with `blocked_linear` rather than PyTorch's
    GEMM: on CPUs whose widest vectors are AVX2's, where PyTorch's MKL path measured 75-120 GFLOPS on
    2 Zen 3 cores against ~140 for `blocked_linear`. `KernelConfig.torch_gemm` keeps PyTorch's."""
    return isa() == 256 and not runtime().config.torch_gemm


def panels_preferred() -> bool:
    """Whether float32 matrices of small passes should be `PanelMatrix`es: on CPUs whose widest vectors
    are AVX2's and big passes use the blocked GEMM, which reads the panels in place (the panel kernels are
    AVX2+FMA code, measured there). `KernelConfig.panels` off keeps row-major matrices."""
    return blocked_preferred() and runtime().config.panels


class Linear:
    """A weight matrix (and bias) checked once, for a hot loop: `linear(x, out)` computes what
    `rowwise_linear(x, weight, bias, out)` does without re-checking the weight on every call.
    x [M, K] and out [M, N] must be contiguous float32 CPU tensors (the caller's own buffers)."""

    __slots__ = ("weight", "bias", "n", "k", "_matrix", "_scale", "_bias", "_format", "_kind", "_product", "_out")

    def __init__(self, weight, bias: torch.Tensor | None = None):
        self.n, self.k = weight.shape
        self._kind = 0  # the ggml block type of a GGUFMatrix
        if bias is not None:
            check(bias)
        if isinstance(weight, GGUFMatrix):
            matrix, self._scale, self._format, self._kind = weight.values, None, Format.GGUF_Q8, weight.kind
        elif isinstance(weight, QuantizedMatrix):
            check(weight.scale)
            matrix, self._scale = weight.values, weight.scale.data_ptr()
            if isinstance(weight, ExactBlocks):
                self._format = weight.format
            elif isinstance(weight, PanelMatrix):
                self._format, self._scale = Format.PANELS, None
            else:
                # int4: the kernel (float or int8 activations) is chosen at each call (`_int4_code`)
                self._format = Format.INT8 if isinstance(weight, Int8Matrix) else Format.INT4
        else:
            if weight.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError("weight must be a float32 or bfloat16 matrix, an Int8Matrix or an Int4Matrix")
            matrix, self._scale = weight, None
            self._format = Format.BF16 if weight.dtype == torch.bfloat16 else Format.F32
        if not matrix.is_contiguous() or matrix.device.type != "cpu":
            raise ValueError("weight must be a contiguous CPU matrix")
        self.weight, self.bias = weight, bias  # kept alive: the pointers below point into them
        self._matrix, self._bias = matrix.data_ptr(), None if bias is None else bias.data_ptr()
        self._product = _product([self])
        self._out = (ctypes.c_void_p * 1)()

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        found = runtime()
        if self._format == Format.INT4:
            self._product.format = found.int4_format
        self._out[0] = out.data_ptr()
        if found.lib.linear_product(self._product, x.data_ptr(), self._out, x.shape[0], found.isa, threads()):
            raise MemoryError("linear_product: out of memory for its scratch buffer")
        return out


def _product(members: list[Linear]) -> abi.Product:
    """The C product of `Linear`s of one format and width (int4's format is set at call time)."""
    product = abi.Product(count=len(members), format=members[0]._format, K=members[0].k)
    for i, lin in enumerate(members):
        product.w[i], product.s[i], product.b[i], product.N[i] = lin._matrix, lin._scale, lin._bias, lin.n
        product.kind[i] = lin._kind
    return product


class _GroupCall:
    """One C call of a `LinearGroup`: its linears of one weight format, as the product the call takes."""

    __slots__ = ("index", "first", "count", "product", "out_ptrs", "outs")

    def __init__(self, index: list[int], members: list[Linear]):
        self.index, self.first, self.count = index, members[0], len(members)
        self.product = _product(members)
        self.out_ptrs = (ctypes.c_void_p * len(members))()
        self.outs = None  # the last call's output pointers, reused while the buffers stay


class LinearGroup:
    """Several `Linear`s of one input width applied to the same x (a layer's q, k and v; gate and up) as
    one kernel call per weight format among them (usually one; a GGUF's v may be Q6_K beside a Q4_K q
    and k): one wake of the thread pool, and int4 drafts round x to int8 once. `group(x, outs)` writes
    outs[i] = linears[i](x); each output is bitwise what its own call gives."""

    __slots__ = ("linears", "_calls")

    def __init__(self, linears: list[Linear]):
        if not 1 <= len(linears) <= abi.MAX_GROUP:
            raise ValueError(f"a LinearGroup holds 1 to {abi.MAX_GROUP} linears")
        if len({lin.k for lin in linears}) != 1:
            raise ValueError("a LinearGroup's linears must share the input width")
        self.linears = list(linears)
        self._calls = []
        for fmt in dict.fromkeys(lin._format for lin in linears):
            index = [i for i, lin in enumerate(linears) if lin._format == fmt]
            self._calls.append(_GroupCall(index, [linears[i] for i in index]))

    def __call__(self, x: torch.Tensor, outs) -> tuple:
        found = runtime()
        for call in self._calls:
            pointers = tuple(outs[i].data_ptr() for i in call.index)
            if pointers != call.outs:
                call.outs = pointers
                call.out_ptrs[:] = pointers
            if call.first._format == Format.INT4:
                call.product.format = found.int4_format
            if found.lib.linear_product(call.product, x.data_ptr(), call.out_ptrs, x.shape[0], found.isa,
                                        threads()):
                raise MemoryError("linear_product: out of memory for its scratch buffer")
        return tuple(outs)


class LayerStack:
    """A decoder's layers run as one C call per small pass (`decoder_layers`): per layer RMSNorm, the q/k/v
    group, RoPE, cache write, `slot_attention`, o, RMSNorm, the gate/up group, SwiGLU and down, the very
    calls of a Python loop over `rms_norm`, `LinearGroup`, `rope_`, ... in the same order, so bitwise the
    same numbers, without their ~250 Python-to-C crossings per pass (~10% of a 4-bit 0.5B draft step).

    Built from one tuple per layer, (attn_norm, qkv: LinearGroup, o: Linear, mlp_norm, gate_up:
    LinearGroup, down: Linear); `LayerStack.build` returns None where a group mixes weight formats
    (a GGUF's Q6_K v beside Q4_K q and k), which only the Python loop runs."""

    __slots__ = ("_layers", "_descs", "_int4", "_int4_format", "_decoder", "_buffers")

    def __init__(self, layers):
        self._layers = layers  # kept alive: the descriptors point into their tensors
        self._descs = (abi.Layer * len(layers))()
        self._int4: list[abi.Product] = []  # products whose format follows `_int4_code()` at call time
        for desc, (attn_norm, qkv, o, mlp_norm, gate_up, down) in zip(self._descs, layers):
            check(attn_norm, mlp_norm)
            desc.attn_norm, desc.mlp_norm = attn_norm.data_ptr(), mlp_norm.data_ptr()
            for name, group in (("qkv", qkv), ("o", LinearGroup([o])), ("gate_up", gate_up), ("down", LinearGroup([down]))):
                (call,) = group._calls
                setattr(desc, name, call.product)  # a copy, into the layer's struct
                if call.first._format == Format.INT4:
                    self._int4.append(getattr(desc, name))  # a view of the layer's struct
        self._int4_format = None  # the format the int4 products were last set to
        self._decoder = abi.Decoder(layers=ctypes.cast(self._descs, ctypes.POINTER(abi.Layer)), count=len(layers))
        self._buffers = None  # the last call's buffer pointers, reused while the buffers stay

    @classmethod
    def build(cls, layers) -> "LayerStack | None":
        """A LayerStack, or None when some group needs more than one kernel call (mixed weight formats)."""
        if any(len(group._calls) != 1 for layer in layers for group in (layer[1], layer[4])):
            return None
        return cls(layers)

    def __call__(self, x: torch.Tensor, buffers: dict[str, torch.Tensor], batch: int, width: int, heads: int,
                 kv_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, start: int, scale: float, eps: float,
                 tree: torch.Tensor | None = None, keys_only_last: bool = False) -> None:
        """Run every layer on x [batch * width, hidden] (updated in place) with `buffers` (NativeCausalLM's
        names, abi.BUFFERS, each [batch * width, ...] contiguous float32); keys [layers, batch, kv_heads,
        capacity/16, head_dim, 16] and values [layers, batch, kv_heads, capacity, head_dim] of the store
        (each layer's block contiguous); positions long [batch * width]; visible, tree as `slot_attention`
        takes them. Afterwards buffers["delta"] holds the last layer's MLP output, not yet added to x
        (keys_only_last: the last layer stops once its keys and values are stored; x and delta then hold
        nothing to read)."""
        found = check(x, keys[0], values[0])
        if found.int4_format != self._int4_format:
            for product in self._int4:
                product.format = found.int4_format
            self._int4_format = found.int4_format
        d = self._decoder
        pointers = tuple(buffers[name].data_ptr() for name in abi.BUFFERS)
        if pointers != self._buffers:
            self._buffers = pointers
            d.buffers[:] = pointers
        _check_masks(visible, tree, batch, width)
        d.x, d.B, d.T, d.hidden, d.H, d.KVH, d.D = x.data_ptr(), batch, width, x.shape[1], heads, kv_heads, head_dim
        d.positions, d.cos_table, d.sin_table = positions.data_ptr(), cos.data_ptr(), sin.data_ptr()
        d.kc, d.kc_stride, d.vc, d.vc_stride = keys.data_ptr(), keys.stride(0), values.data_ptr(), values.stride(0)
        d.cap, d.vis, d.vis_stride = values.shape[3], visible.data_ptr(), visible.stride(0)
        d.tree, d.start, d.scale, d.eps = None if tree is None else tree.data_ptr(), start, scale, eps
        d.keys_only_last = keys_only_last
        if found.lib.decoder_layers(d, found.isa, threads()):
            raise MemoryError("decoder_layers: out of memory for a scratch buffer")


def rowwise_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> out [M, N], float32. Each output row depends on its input row only, bitwise.

    weight may be float32, bfloat16 (half the bytes), an `Int8Matrix` (a quarter) or an `Int4Matrix`
    (about a seventh): the narrower formats are converted exactly and accumulated in float32, but
    their rounded weights change the result: a draft-model option, not for a target. int4 matrices
    also round each activation row to int8 per group of 64 (unless `KernelConfig.int8_activations` is off).
    `ExactBlocks` (GGUF Q4_K / Q6_K) give bitwise the float32 matrix's result: fine for a target.
    """
    rows, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    check(x, out)
    return Linear(weight, bias)(x, out)


def blocked_takes(weight) -> bool:
    """Whether `blocked_linear` multiplies this weight: a float32 matrix, a `PanelMatrix`, an `Int4Matrix`,
    or exact blocks (through their float32 matrix)."""
    return (isinstance(weight, (Int4Matrix, ExactBlocks, PanelMatrix))
            or (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32))


def blocked_linear(x: torch.Tensor, weights, biases=None) -> list[torch.Tensor]:
    """x [..., K] @ weights[i] [N_i, K].T (+ biases[i] [N_i]) -> [..., N_i] float32 for each of up to 4
    matrices sharing x, for many rows at once (a prompt's prefill): a blocked GEMM with packed register
    tiles, AVX2+FMA, x packed once for the group. A weight is float32, a `PanelMatrix` (read in place)
    or an `Int4Matrix` (widened to float32 panel by panel, no widened copy kept). Rows are independent
    (a row's numbers do not depend on the others or on how many there are) but differ from
    `rowwise_linear`'s in the last bits: another summation order."""
    count = len(weights)
    biases = [None] * count if biases is None else list(biases)
    if not 1 <= count <= abi.MAX_GROUP or len(biases) != count:
        raise ValueError(f"blocked_linear takes 1 to {abi.MAX_GROUP} matrices, and as many biases (or None)")
    k = x.shape[-1]
    for weight in weights:
        if not blocked_takes(weight) or weight.shape[1] != k:
            raise ValueError(f"weights must be float32 [N, {k}] matrices or Int4Matrix, got {weight.dtype} {tuple(weight.shape)}")
    weights = [w.dense if isinstance(w, ExactBlocks) else w for w in weights]
    rows = x.reshape(-1, k).contiguous()
    outs = [torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32) for weight in weights]
    codes = [w.values if isinstance(w, (Int4Matrix, PanelMatrix)) else w for w in weights]
    scales = [w.scale if isinstance(w, Int4Matrix) else None for w in weights]
    found = check(rows, *outs, *(t for t in (*biases, *scales) if t is not None))
    if any(not c.is_contiguous() or c.device.type != "cpu" for c in codes):
        raise ValueError("weights must be contiguous CPU matrices")
    if rows.shape[0] and k:
        packed = torch.empty(-(-rows.shape[0] // 6) * 6 * k, dtype=torch.float32)  # x in 6-row panels
        call = abi.Blocked(count=count, M=rows.shape[0], K=k, x=rows.data_ptr(), xp=packed.data_ptr())
        for i, (weight, code, scale, bias, out) in enumerate(zip(weights, codes, scales, biases, outs)):
            call.w[i], call.N[i], call.y[i] = code.data_ptr(), weight.shape[0], out.data_ptr()
            call.s[i] = None if scale is None else scale.data_ptr()
            call.b[i] = None if bias is None else bias.data_ptr()
            call.kind[i] = (abi.BlockedKind.INT4 if isinstance(weight, Int4Matrix)
                            else abi.BlockedKind.PANELS if isinstance(weight, PanelMatrix) else abi.BlockedKind.F32)
        found.lib.blocked_linear(call, threads())
    elif rows.shape[0]:  # K = 0: the empty sum
        for out, bias in zip(outs, biases):
            out.copy_(torch.zeros_like(out) if bias is None else bias.expand_as(out))
    return outs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """out = RMSNorm(x) * weight per row of x [M, D]; with `residual` [M, D], first x += residual (in place)."""
    found = check(x, weight, out, *(() if residual is None else (residual,)))
    found.lib.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                       out.data_ptr(), x.shape[0], x.shape[1], eps, found.isa)
    return out


def rope_(x: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [M, heads * D] in place: row m by the angles of positions[m] (long [M]); cos/sin [P, D]."""
    found = check(x, cos, sin)
    if positions.dtype != torch.long or not positions.is_contiguous():
        raise ValueError("positions must be a contiguous long tensor")
    found.lib.rope(x.data_ptr(), x.shape[0], x.shape[1], heads, cos.shape[1], positions.data_ptr(), cos.data_ptr(),
                   sin.data_ptr())
    return x


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate <- silu(gate) * up, in place (the SwiGLU product of Shazeer 2020)."""
    found = check(gate, up)
    found.lib.silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), found.isa)
    return gate


def cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> None:
    """Store new keys/values [B, T, KVH, D] at slots start.. of k_cache [B, KVH, capacity/16, D, 16]
    (`SLOT_BLOCK`-slot blocks) and v_cache [B, KVH, capacity, D]."""
    found = check(k, v, k_cache, v_cache)
    batch, width, kv_heads, head_dim = k.shape
    found.lib.cache_write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), batch, width, kv_heads,
                          head_dim, v_cache.shape[2], start)


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                   start: int, scale: float, out: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of T new tokens per row over the visible slots of a cache.

    q [B, T, H, D]; k_cache [B, KVH, capacity/16, D, 16] and v_cache [B, KVH, capacity, D], with the
    new tokens' keys/values already at slots start .. start+T-1; visible [B, >= start+T] bool (unit
    column stride). Query t of row b attends to slots s <= start+t with visible[b, s]; a query that
    sees nothing (padding) gets zeros. Returns out [B, T, H, D].

    tree [B, T, T] bool (a token tree: tree[b, t, j] when new token j is t or an ancestor of t, so
    j <= t): new slot start+j is then seen by query t only where tree[b, t, j]. A token's result is
    bitwise what it would be with only its own path in the cache.
    """
    batch, width, heads, head_dim = q.shape
    lanes = 16 if isa() == 512 else 8
    if head_dim % lanes:
        raise ValueError(f"head size {head_dim} is not a multiple of {lanes}: use scaled_dot_product_attention")
    if out is None:
        out = torch.empty_like(q)
    found = check(q, k_cache, v_cache, out)
    _check_masks(visible, tree, batch, width)
    call = abi.Attention(q=q.data_ptr(), kc=k_cache.data_ptr(), vc=v_cache.data_ptr(), vis=visible.data_ptr(),
                         tree=None if tree is None else tree.data_ptr(), out=out.data_ptr(), B=batch, T=width, H=heads,
                         KVH=k_cache.shape[1], D=head_dim, cap=v_cache.shape[2], vis_stride=visible.stride(0),
                         start=start, scale=scale)
    if found.lib.slot_attention(call, found.isa, threads()):
        raise MemoryError("slot_attention could not allocate its score buffer")
    return out
