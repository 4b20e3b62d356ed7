"""Weight matrices in the formats the kernels read: quantized for drafts (`Int8Matrix`, `Int4Matrix`),
exact for targets (`Q4KMatrix`, `Q6KMatrix`: GGUF k-quant blocks, bitwise the float32 matrix), and
float32 in the blocked GEMM's panels (`PanelMatrix`). Each knows its layout and how to widen itself
back to a dense tensor; the products live in `ops`."""

from __future__ import annotations

import numpy as np
import torch

from verispec.models.kernels import abi, pages
from verispec.models.kernels.runtime import available, check, runtime
from verispec.models.kernels.threads import threads

class QuantizedMatrix:
    """Integer weight codes `values` and float32 `scale`s standing for a float matrix [N, K]; rows
    are output features. Subclasses define the format (`quantize`, `dequantize`, `shape`, `dtype`)."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor):
        self.values, self.scale = values, scale
        self._widened: dict[torch.dtype, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.values.device

    def is_contiguous(self) -> bool:
        return self.values.is_contiguous() and self.scale.is_contiguous()

    def __getitem__(self, rows) -> "QuantizedMatrix":
        """A subset of output rows (e.g. a restricted vocabulary), as a new matrix."""
        return type(self)(self.values[rows].contiguous(), self.scale[rows].contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """`dequantize(dtype)`, computed on the first call and kept: big passes (prefill) multiply it
        (for a 0.5B draft, widening at every prefill cost ~1 s; the bfloat16 copy is 1 GB)."""
        if dtype not in self._widened:
            self._widened[dtype] = self.dequantize(dtype)
        return self._widened[dtype]


class Int8Matrix(QuantizedMatrix):
    """Weight-only int8 storage: w[n, k] ~ values[n, k] * scale[n], symmetric, one scale per output row.

    A quarter of float32's bytes. Only the weights are rounded (once, at load); activations stay
    float32 and are never quantized, so each output row still depends on its own input row alone.
    values [N, K] int8, scale [N] float32.
    """

    dtype = torch.int8

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Matrix":
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        values = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(values.contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.values.to(dtype) * self.scale[:, None].to(dtype)


class Int4Matrix(QuantizedMatrix):
    """Weight-only 4-bit storage in groups: w[n, k] ~ (values - 8) * scale[n, k // GROUP], symmetric.

    Two weights per byte: byte j of a group of `GROUP` weights holds weight j (low nibble) and weight
    j + GROUP/2 (high nibble), the layout the kernels unpack. About a seventh of float32's bytes
    with the scales (0.5625 bytes per weight). values [N, K / 2] uint8, scale [N, K / GROUP] float32.
    """

    GROUP = abi.I4GROUP
    dtype = torch.quint4x2  # the tag for this format: two 4-bit values per byte

    # Each group's scale: of a few clipping ranges (amax/7 shrunk by up to 30%), the one with the least
    # squared rounding error; clipping a lone outlier often serves the other 63 weights better.
    SHRINKS = torch.linspace(1.0, 0.7, 7)  # at most abi.I4MAXSHRINKS

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int4Matrix":
        n, k = weight.shape
        if k % cls.GROUP:
            raise ValueError(f"int4 weights need in_features divisible by {cls.GROUP}, got {k}: use int8")
        if not available():
            return cls.quantize_reference(weight)
        weight = weight.detach().float().contiguous()
        packed = torch.empty(n, k // 2, dtype=torch.uint8)
        scale = torch.empty(n, k // cls.GROUP)
        found = runtime()
        if found.lib.int4_quantize(weight.data_ptr(), packed.data_ptr(), scale.data_ptr(), cls.SHRINKS.data_ptr(), n, k,
                                   len(cls.SHRINKS), found.isa, threads()):
            raise ValueError(f"int4 quantization takes 1 to {abi.I4MAXSHRINKS} candidate scales")
        return cls(packed, scale)

    @classmethod
    def quantize_reference(cls, weight: torch.Tensor) -> "Int4Matrix":
        """`quantize` in PyTorch ops (where the C kernels are unavailable; the tests compare both)."""
        n, k = weight.shape
        groups = weight.detach().float().reshape(n, k // cls.GROUP, cls.GROUP)
        peak = groups.abs().amax(dim=2).clamp(min=1e-12)
        scale, best = peak / 7.0, None
        for shrink in cls.SHRINKS.tolist():
            candidate = peak * shrink / 7.0
            rounded = torch.round(groups * (1.0 / candidate)[..., None]).clamp(-8, 7) * candidate[..., None]
            error = (rounded - groups).pow(2).sum(dim=2)
            if best is None:
                best = error
            else:
                better = error < best
                scale, best = torch.where(better, candidate, scale), torch.where(better, error, best)
        q = (torch.round(groups * (1.0 / scale)[..., None]).clamp(-8, 7) + 8).to(torch.uint8)
        half = cls.GROUP // 2
        packed = q[..., :half] | (q[..., half:] << 4)
        return cls(packed.reshape(n, k // 2).contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.values.shape[0], self.values.shape[1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, half = self.values.shape[0], self.GROUP // 2
        packed = self.values.reshape(n, -1, half)
        q = torch.cat((packed & 15, packed >> 4), dim=2).to(torch.float32) - 8
        return (q * self.scale[..., None]).reshape(n, -1).to(dtype)


class ExactBlocks(QuantizedMatrix):
    """A float32 matrix kept as the GGUF k-quant blocks it was dequantized from, with the float32 matrix
    itself (`dense`, shared, not copied) for big passes. The kernels rebuild every weight with the
    operations of gguf's reference dequantizer, rounded alike, and then run the float32 arithmetic:
    a product is bit for bit the float32 matrix's, from a fifth (Q4_K) to a third (Q6_K) of its bytes
    per token. Unlike the draft formats above, a target may use these. `build` checks every weight
    against `dense` and returns None if any bit differs."""

    dtype = torch.float32  # the numbers are the float32 matrix's
    format: abi.Format  # the C kernels' weight format

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, dense: torch.Tensor):
        super().__init__(values, scale)
        self.dense = dense

    @classmethod
    def build(cls, values: torch.Tensor, scale: torch.Tensor, dense: torch.Tensor) -> "ExactBlocks | None":
        """The blocks as a matrix standing for `dense` [N, K], or None unless they rebuild it exactly."""
        n, k = dense.shape
        if k % 256 or not available():
            return None
        values, scale = values.contiguous(), scale.contiguous()
        found = check(dense, scale)
        if values.device.type != "cpu" or values.numel() * (2 if cls.format == abi.Format.Q4K else 1) != n * k or scale.numel() * 16 != n * k:
            raise ValueError(f"blocks of {cls.__name__} do not cover a [{n}, {k}] matrix")
        first = found.lib.exact_blocks_mismatch(values.data_ptr(), scale.data_ptr(), dense.data_ptr(), n, k, cls.format)
        if first < 0:
            raise MemoryError("exact_blocks_mismatch: out of memory for its scratch row")
        return cls(values, scale, dense) if first == n else None

    @property
    def shape(self) -> torch.Size:
        return self.dense.shape

    def __getitem__(self, rows) -> "ExactBlocks":
        return type(self)(self.values[rows].contiguous(), self.scale[rows].contiguous(), self.dense[rows].contiguous())

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dense if dtype == torch.float32 else self.dense.to(dtype)


class Q4KMatrix(ExactBlocks):
    """Q4_K: codes [N, K / 2] uint8 in 64-weight groups (byte j: weight j low, weight j + 32 high, the
    super-block order), scale [N, K / 32, 2] each 32 weights' (scale, min); w = (scale * q) - min."""

    format = abi.Format.Q4K

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n = self.values.shape[0]
        packed = self.values.reshape(n, -1, 32)
        q = torch.stack((packed & 15, packed >> 4), dim=2).reshape(n, -1, 32).to(torch.float32)
        pairs = self.scale.reshape(n, -1, 2)
        return (pairs[..., 0:1] * q - pairs[..., 1:2]).reshape(n, -1).to(dtype)


class Q6KMatrix(ExactBlocks):
    """Q6_K: codes [N, K] int8 in [-32, 31], scale [N, K / 16] one per 16 weights; w = scale * q."""

    format = abi.Format.Q6K

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n = self.values.shape[0]
        q = self.values.reshape(n, -1, 16).to(torch.float32)
        return (self.scale.reshape(n, -1, 1) * q).reshape(n, -1).to(dtype)


# verispec's own 32-weight block type (no ggml type and no file has it; the id only has to differ from ggml's):
# a half-float scale d and 3-bit codes, weight = (code - 4) * d, 14 bytes per 32 weights (3.5 bits a weight
# against Q4_0's 4.5). A draft model's matrices only shape proposals and its decode step streams them, so fewer
# bits a weight make a cheaper step; on a draft's MLP gate and up matrices 3 bits cost little agreement with the
# target (bench/README, "3-bit draft blocks"). The kernels take them as the 32-weight ggml types
# (csrc/quant32_q8.c, activations rounded as Q8_0).
Q3_0 = 99


def _searched_scale(x: torch.Tensor, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d [..., 1] as a half float's value, codes [..., 32] in low..high) for blocks x [..., 32]: the codes are
    round-to-nearest(x / d) under whichever scale leaves the least squared error of ggml's rule (the block's
    largest-magnitude weight, sign kept, onto the lowest code: d = peak / low), that d over 0.75 .. 1.1, and each
    of those refitted by least squares to its codes (few levels, and a block's peak is often a lone outlier that
    one scale cannot serve with the rest)."""
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))

    def codes(d: torch.Tensor) -> torch.Tensor:
        return torch.round(x * torch.where(d != 0, 1.0 / d, torch.zeros_like(d))).clamp_(low, high)

    best_d = best_err = None
    for shrink in (1.0, 1.1, 1.05, 0.95, 0.9, 0.85, 0.8, 0.75):
        d = peak / (low * shrink)
        for refit in (False, True):
            if refit:  # the least-squares scale for the codes just made
                norm = q.square().sum(-1, keepdim=True)
                d = torch.where(norm > 0, (q * x).sum(-1, keepdim=True) / norm.clamp(min=1), d)
            d = d.half().float()
            q = codes(d)
            err = (q * d - x).square_().sum(-1, keepdim=True)
            if best_err is None:
                best_d, best_err = d, err
            else:  # the codes are d's: only the scale is kept, and the codes made once from the best
                best_d = torch.where(err < best_err, d, best_d)
                best_err = torch.minimum(err, best_err)
    return best_d, codes(best_d)


def _quantize_q3_0(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 32 weights x [..., 32] -> Q3_0 bytes [..., 14]: d (half float), then the codes' low bit pairs
    (weight j at bits 2 (j % 4) of byte j / 4) and high bits (weight j at bit j % 8 of byte 8 + j / 8). Codes
    are round-to-nearest(x / d) + 4 in 0..7 under the scale `_searched_scale` finds."""
    best_d, codes = _searched_scale(x, -4, 3)
    codes = (codes + 4).to(torch.uint8)
    low = (codes & 3).reshape(*x.shape[:-1], 8, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    high = (codes >> 2).reshape(*x.shape[:-1], 4, 8) << torch.arange(8, dtype=torch.uint8)
    scale = best_d[..., 0].half().view(torch.uint8).reshape(*x.shape[:-1], 2)
    return torch.cat([scale, low.sum(-1, dtype=torch.uint8), high.sum(-1, dtype=torch.uint8)], -1)


class GGUFMatrix(QuantizedMatrix):
    """A GGUF file's quantized matrix [N, K] (Q4_K, Q5_K, Q6_K, or the 32-weight Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
    multiplied with llama.cpp's numerics: each activation row rounded to 8 bits per block as ggml does for
    the matrix's type (Q8_K per 256 for the k-quants, Q8_0 / Q8_1 per 32 for the others), integer dot
    products against the blocks' codes, the blocks' scales applied in float32 (see csrc/kquant_q8.c and
    csrc/quant32_q8.c for the exact recipes). The integer parts are ggml's to the bit; the float parts are
    summed in another order than llama.cpp's SIMD kernels, so outputs agree with llama.cpp's to float32
    rounding, not bitwise. These are not the float32 model's numbers: a target in this mode is its own
    target (`numerics="q8"`), and every row's result is bitwise the same at any pass width, so speculation
    is exact with respect to it.

    blocks [N, K / block weights * block bytes] uint8: the rows' blocks as the file stores them (per 256
    weights 144 bytes for Q4_K, 176 for Q5_K, 210 for Q6_K; per 32 weights 18 for Q4_0, 20 Q4_1, 22 Q5_0,
    24 Q5_1, 34 Q8_0), typically a view of the memory-mapped file; embedding lookups (`rows`) read them.
    `values`: the same codes and scales repacked for the kernels, 16 columns interleaved
    (csrc/kquant_q8_pack.c, csrc/quant32_q8_pack.c; 2-3% more bytes for Q4_K and Q5_K, as many for the
    rest), made on first use so a table only looked up (an untied embedding) is never repacked. `kind` the
    ggml type id (12 Q4_K, 13 Q5_K, 14 Q6_K, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0), or `Q3_0` for verispec's
    own 3-bit draft blocks (14 bytes per 32 weights; made by `quantize`, never read from a file)."""

    dtype = torch.float32  # activations in and outputs out are float32
    # ggml type id: (name, bytes per block, weights per block, bytes of a repacked group's block)
    KINDS = {12: ("Q4_K", 144, 256, 2368), 13: ("Q5_K", 176, 256, 2880), 14: ("Q6_K", 210, 256, 3360),
             2: ("Q4_0", 18, 32, 288), 3: ("Q4_1", 20, 32, 320), 6: ("Q5_0", 22, 32, 352), 7: ("Q5_1", 24, 32, 384),
             8: ("Q8_0", 34, 32, 544), Q3_0: ("Q3_0", 14, 32, 224)}
    GROUP = 16  # columns per repacked group

    def __init__(self, blocks: torch.Tensor, kind: int):
        if kind not in self.KINDS:
            names = ", ".join(f"{name} ({k})" for k, (name, *_) in self.KINDS.items())
            raise ValueError(f"GGUFMatrix holds {names} blocks, not ggml type {kind}")
        name, size, weights, _ = self.KINDS[kind]
        if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % size:
            raise ValueError(f"{name} blocks must be a uint8 [N, K / {weights} * {size}] tensor")
        self.blocks, self.kind = blocks, kind
        self.scale = torch.empty(0)  # the scales are inside the blocks
        self._packed: torch.Tensor | None = None
        self._widened = {}

    @property
    def values(self) -> torch.Tensor:
        """The blocks repacked for the kernels, uint8 [ceil(N / 16), K / block weights * group bytes] (made once)."""
        if self._packed is None:
            if not available():
                raise RuntimeError("GGUFMatrix products need verispec's C kernels (a C compiler and an AVX2 CPU)")
            n, k = self.shape
            name, _, weights, group_bytes = self.KINDS[self.kind]
            groups = -(-n // self.GROUP)
            packed = pages.empty((groups, k // weights * group_bytes))  # streamed every step: on huge pages
            blocks = self.blocks.contiguous()
            if runtime().lib.gguf_q8_repack(blocks.data_ptr(), packed.data_ptr(), n, k, self.kind,
                                            threads()):
                raise ValueError(f"cannot repack a [{n}, {k}] {name} matrix")
            self._packed = packed
        return self._packed

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def is_contiguous(self) -> bool:
        return self.blocks.is_contiguous()

    @property
    def block_bytes(self) -> int:
        return self.KINDS[self.kind][1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] // self.block_bytes * self.KINDS[self.kind][2]))

    def __getitem__(self, rows) -> "GGUFMatrix":
        return GGUFMatrix(self.blocks[rows].contiguous(), self.kind)

    # the 32-weight types `quantize` makes, by name: type id
    MADE = {"q4_0": 2, "q8_0": 8, "q3_0": Q3_0}

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: int = 2, search: bool = False) -> "GGUFMatrix":
        """A float matrix [N, K] (K a multiple of 32) rounded to Q4_0 (kind 2) or Q8_0 (kind 8) blocks by ggml's
        reference recipe (quantize_row_q4_0_ref / q8_0_ref: the bytes gguf-py and llama-quantize write), or to
        verispec's own 3-bit blocks (`Q3_0`; see `_quantize_q3_0`). search (Q4_0): each block's scale the one
        `_searched_scale` finds instead of ggml's rule (the same format, less squared error).

        For drafts (a head's or a draft model's matrices), whose numbers only shape proposals: the q8 kernels
        multiply 4-bit blocks about twice as fast as `Int4Matrix`'s at one to eight rows (repacked columns, one
        vpdpbusd per four weights), and the file format is llama.cpp's own."""
        if kind not in (2, 8, Q3_0):
            raise ValueError(f"GGUFMatrix.quantize makes Q4_0 (2), Q8_0 (8) or Q3_0 ({Q3_0}) blocks, not type {kind}")
        w = weight.detach().float()
        n, k = w.shape
        if k % 32:
            raise ValueError(f"a {cls.KINDS[kind][0]} matrix's rows must be whole blocks of 32 weights, got {k}")
        x = w.reshape(n, k // 32, 32)
        if kind == Q3_0:
            return cls(_quantize_q3_0(x).reshape(n, -1).contiguous(), kind)
        if kind == 2 and search:
            d, codes = _searched_scale(x, -8, 7)
            d, codes = d[..., 0], (codes + 8).to(torch.uint8)
            body = codes[..., :16] | (codes[..., 16:] << 4)
        elif kind == 2:
            # d = the block's largest-magnitude weight (first of ties, sign kept) / -8; codes floor(x / d + 8.5) <= 15
            peak = x.gather(2, x.abs().argmax(2, keepdim=True))[..., 0]
            d = peak / -8.0
            inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
            codes = torch.floor(x * inverse[..., None] + 8.5).clamp(max=15).to(torch.uint8)
            body = codes[..., :16] | (codes[..., 16:] << 4)
        else:
            # d = max |w| / 127; codes round-half-away(x / d)
            d = x.abs().amax(2) / 127.0
            inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
            scaled = x * inverse[..., None]
            body = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8).view(torch.uint8)
        scale = d.to(torch.float16).view(torch.uint8).reshape(n, k // 32, 2)
        return cls(torch.cat([scale, body], 2).reshape(n, -1).contiguous(), kind)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float32 weights ggml's dequantizer makes of the blocks (what a float32 conversion holds)."""
        return self.rows(torch.arange(self.blocks.shape[0])).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (long [...]) dequantized to float32 [..., K]: an embedding lookup on a quantized table,
        bitwise ggml's dequantize_row_* (in C when the kernels are built: a decode step's lookup is then
        microseconds, not a millisecond of numpy)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        n, k = self.shape
        if available() and self.blocks.is_contiguous():
            flat = ids.reshape(-1).to(torch.int64).contiguous()
            out = torch.empty(flat.numel(), k, dtype=torch.float32)
            failed = runtime().lib.gguf_dequantize_rows(self.blocks.data_ptr(), flat.data_ptr(), flat.numel(), n, k,
                                                        self.kind, out.data_ptr())
            if failed:
                raise IndexError(f"token ids out of range for a {n}-row table" if failed == 2 else "bad block table")
            return out.reshape(*ids.shape, k)
        if self.kind == Q3_0:
            raise RuntimeError("Q3_0 blocks are verispec's own: reading them needs the C kernels")
        raw = self.blocks[ids.reshape(-1)].numpy()
        dense = dequantize(raw, getattr(GGMLQuantizationType, self.KINDS[self.kind][0]))
        return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).reshape(*ids.shape, -1)


class PanelMatrix(QuantizedMatrix):
    """A float32 matrix [N, K] stored in panels of 16 rows, k-major: values [ceil(N / 16), K, 16], rows
    past N zero. The same numbers as the float32 matrix (nothing is rounded), in the order the AVX2
    kernels read them: a small pass streams the matrix front to back, which on 2 Zen 3 cores ran a
    one-row pass at the memory's speed and kept 8-16-row passes within ~1.3-1.8x of it (row-major
    tiles: 1.45-2.3x), and prefill's GEMM uses the panels in place instead of packing them per call.
    Each output row of a pass is bitwise the same whatever the other rows (see panel_linear_group),
    though it differs in the last bits from a row-major float32 product (another summation order)."""

    dtype = torch.float32  # the numbers are the float32 matrix's
    ROWS = 16

    def __init__(self, values: torch.Tensor, scale: torch.Tensor | None = None, rows: int | None = None):
        super().__init__(values, torch.empty(0) if scale is None else scale)
        self.rows = values.shape[0] * self.ROWS if rows is None else rows

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "PanelMatrix":
        n, k = weight.shape
        padded = -(-n // cls.ROWS) * cls.ROWS
        w = weight.detach().float()
        if padded != n:
            w = torch.cat((w, w.new_zeros(padded - n, k)))
        return cls(w.view(padded // cls.ROWS, cls.ROWS, k).transpose(1, 2).contiguous(), rows=n)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.values.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k = self.values.shape[1]
        return self.values.transpose(1, 2).reshape(-1, k)[: self.rows].to(dtype).contiguous()

    def __getitem__(self, rows) -> "PanelMatrix":
        return self.pack(self.dequantize()[rows])
