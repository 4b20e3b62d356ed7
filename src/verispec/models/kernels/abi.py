"""The C library's interface, bound in one place: the weight formats and constants read from the C
headers themselves (so Python and C cannot disagree), a ctypes mirror of each struct of
csrc/kernels.h, and the signature of every exported function.
"""

from __future__ import annotations

import ctypes
import enum
import re
from pathlib import Path

from verispec.models.kernels.build import CSRC


def _enum(header: Path, name: str, prefix: str) -> dict[str, int]:
    """The enumerators of `enum name { ... }` in header that start with prefix, without it."""
    body = re.search(r"enum\s+" + name + r"\s*\{(.*?)\}", header.read_text(), re.S).group(1)
    return {m[1]: int(m[2]) for m in re.finditer(r"\b" + prefix + r"(\w+)\s*=\s*(\d+)", body)}


def _define(header: Path, name: str) -> int:
    return int(re.search(r"#define\s+" + name + r"\s+(\d+)", header.read_text()).group(1))


Format = enum.IntEnum("Format", _enum(CSRC / "formats.h", "vs_format", "VS_"))
Format.__doc__ = "A weight format of a linear product (csrc/formats.h: enum vs_format)."
BlockedKind = enum.IntEnum("BlockedKind", _enum(CSRC / "formats.h", "vs_blocked_kind", "VS_BLOCKED_"))
BlockedKind.__doc__ = "How the prefill GEMM reads a matrix (csrc/formats.h: enum vs_blocked_kind)."

MAX_GROUP = _define(CSRC / "kernels.h", "VS_MAX_GROUP")  # matrices per product
SLOT_BLOCK = _define(CSRC / "common.h", "SLOT_BLOCK")  # slots per key block of the cache
I4GROUP = _define(CSRC / "common.h", "I4GROUP")  # int4 weights per scale
I4MAXSHRINKS = _define(CSRC / "common.h", "I4MAXSHRINKS")  # candidate scales per int4 group, at most
# decoder_layers' scratch buffers, in the order of kernels.h's enum (VS_NORMED, ...): "normed", ...
_buffers = re.search(r"enum\s*\{\s*(VS_NORMED[^}]*)\}", (CSRC / "kernels.h").read_text()).group(1)
BUFFERS = tuple(name.strip()[3:].lower() for name in _buffers.split(",") if name.strip() != "VS_BUFFERS")

_group = ctypes.c_void_p * MAX_GROUP


class Product(ctypes.Structure):
    """C `vs_product`: one kernel call's matrices (a `LinearGroup` of one weight format)."""

    _fields_ = [("count", ctypes.c_int), ("format", ctypes.c_int), ("K", ctypes.c_int64),
                ("w", _group), ("s", _group), ("b", _group), ("N", ctypes.c_int64 * MAX_GROUP),
                ("kind", ctypes.c_int * MAX_GROUP)]


class Layer(ctypes.Structure):
    """C `vs_layer`: a decoder layer's norms and its four products."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("qkv", Product), ("o", Product), ("gate_up", Product), ("down", Product)]


class Attention(ctypes.Structure):
    """C `vs_attention`: one slot attention call."""

    _fields_ = [("q", ctypes.c_void_p), ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
                ("vis", ctypes.c_void_p), ("tree", ctypes.c_void_p), ("out", ctypes.c_void_p),
                *((name, ctypes.c_int64) for name in ("B", "T", "H", "KVH", "D", "cap", "vis_stride", "start")),
                ("scale", ctypes.c_float)]


class Decoder(ctypes.Structure):
    """C `vs_decoder`: every decoder layer of a small pass, with the pass's buffers and cache."""

    _fields_ = [("layers", ctypes.POINTER(Layer)), ("count", ctypes.c_int64), ("x", ctypes.c_void_p),
                ("buffers", ctypes.c_void_p * len(BUFFERS)),
                *((name, ctypes.c_int64) for name in ("B", "T", "hidden", "H", "KVH", "D")),
                ("positions", ctypes.c_void_p), ("cos_table", ctypes.c_void_p), ("sin_table", ctypes.c_void_p),
                ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
                ("kc_stride", ctypes.c_int64), ("vc_stride", ctypes.c_int64), ("cap", ctypes.c_int64),
                ("vis", ctypes.c_void_p), ("tree", ctypes.c_void_p), ("vis_stride", ctypes.c_int64),
                ("start", ctypes.c_int64), ("scale", ctypes.c_float), ("eps", ctypes.c_float),
                ("keys_only_last", ctypes.c_int32)]


class Blocked(ctypes.Structure):
    """C `vs_blocked`: one call of the prefill GEMM."""

    _fields_ = [("count", ctypes.c_int), ("M", ctypes.c_int64), ("K", ctypes.c_int64),
                ("x", ctypes.c_void_p), ("xp", ctypes.c_void_p), ("w", _group), ("s", _group), ("b", _group),
                ("y", _group), ("N", ctypes.c_int64 * MAX_GROUP), ("kind", ctypes.c_int * MAX_GROUP)]


_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "kernels_isa": (_i, []),
    "kernels_vnni": (_i, []),
    "kernels_amx": (_i, [_i]),
    "linear_product": (_i, [ctypes.POINTER(Product), _p, _p, _i64, _i, _i]),
    "blocked_linear": (None, [ctypes.POINTER(Blocked), _i]),
    "exact_blocks_mismatch": (_i64, [_p, _p, _p, _i64, _i64, _i]),
    "gguf_q8_repack": (_i, [_p, _p, _i64, _i64, _i, _i]),
    "gguf_dequantize_rows": (_i, [_p, _p, _i64, _i64, _i64, _i, _p]),
    "int4_quantize": (_i, [_p, _p, _p, _p, _i64, _i64, _i, _i, _i]),
    "silu_mul": (None, [_p, _p, _i64, _i]),
    "rms_norm": (None, [_p, _p, _p, _p, _i64, _i64, _f, _i]),
    "rope": (None, [_p, _i64, _i64, _i64, _i64, _p, _p, _p]),
    "cache_write": (None, [_p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64]),
    "slot_attention": (_i, [ctypes.POINTER(Attention), _i, _i]),
    "decoder_layers": (_i, [ctypes.POINTER(Decoder), _i, _i]),
}


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """The library with every function's argument and return types set."""
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library
