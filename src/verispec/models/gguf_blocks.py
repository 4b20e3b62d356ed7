"""A GGUF file's k-quant blocks as exact weight matrices for the float32 model converted from it.

The zoo's models are GGUF files (Q4_K and Q6_K blocks, mostly) converted to float32: every weight
is what gguf's reference dequantizer computes from its block. Read per token in float32 that is
7.1 GB for Qwen2.5-Coder 1.5B; kept as the blocks, 1.4 GB. `kernels.Q4KMatrix` / `Q6KMatrix` rebuild
each weight with the dequantizer's own operations before the float32 arithmetic, so nothing about
the model's numbers changes, and every matrix is checked bit for bit against its float32 original
before it is used (a matrix that does not match stays float32).

Block layouts (ggml's `block_q4_K` and `block_q6_K`, 256 weights each):
Q4_K, 144 bytes: d (f16), dmin (f16), 12 bytes of 6-bit (scale, min) codes for its eight 32-weight
  sub-blocks, 128 bytes of 4-bit q; w = (d * sc) * q - (dmin * m).
Q6_K, 210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 weights),
  d (f16); w = (d * sc) * (q - 32).
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import numpy as np
import torch

from verispec.models import kernels

log = logging.getLogger(__name__)

Q4_K_BYTES = 144
Q6_K_BYTES = 210
BLOCK = 256


def q4k_parts(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K blocks of an [n, k] matrix -> (codes [n, k / 2] uint8, (scale, min) pairs [n, k / 32, 2] float32)."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, Q4_K_BYTES)
    if blocks.shape[0] * BLOCK != n * k:
        raise ValueError(f"{blocks.shape[0]} Q4_K blocks do not hold a [{n}, {k}] matrix")
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16]
    # 6-bit codes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks
    # 4-7 in the nibbles of bytes 8-11, with their top two bits in the top bits of bytes 0-7.
    first, second, third = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate((first & 63, (third & 15) | ((first >> 6) << 4)), axis=1)
    mn = np.concatenate((second & 63, (third >> 4) | ((second >> 6) << 4)), axis=1)
    scale = d * sc.astype(np.float32)  # [B, 8]: float32 products, rounded once, as the dequantizer
    low = dmin * mn.astype(np.float32)
    pairs = np.stack((scale, low), axis=2).reshape(n, k // 32, 2)
    codes = blocks[:, 16:].reshape(n, k // 2)  # already in the kernels' order: see Q4KMatrix
    return torch.from_numpy(codes.copy()), torch.from_numpy(np.ascontiguousarray(pairs))


def q6k_parts(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks of an [n, k] matrix -> (q [n, k] int8 in [-32, 31], scales [n, k / 16] float32)."""
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1, Q6_K_BYTES))  # a writable copy
    if blocks.shape[0] * BLOCK != n * k:
        raise ValueError(f"{blocks.shape[0]} Q6_K blocks do not hold a [{n}, {k}] matrix")
    count = blocks.shape[0]
    low, high = blocks[:, 0:128].reshape(count, 2, 1, 64), blocks[:, 128:192].reshape(count, 2, 1, 32)
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()
    # Each 128-weight half: weight 64 * s + i takes nibble s of low byte i; weight 32 * t + i takes
    # bits 2t..2t+1 of high byte i as its top two bits.
    nibbles = (low >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 15
    tops = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = (nibbles.reshape(count, 2, 128) | (tops.reshape(count, 2, 128) << 4)).view(torch.int8) - 32
    scales = (d * sc).reshape(n, k // 16)  # float32 products, rounded once, as the dequantizer
    return q.reshape(n, k).contiguous(), scales.contiguous()


_FORMATS = {"Q4_K": (q4k_parts, kernels.Q4KMatrix), "Q6_K": (q6k_parts, kernels.Q6KMatrix)}


def exact_matrix(kind: str, raw: np.ndarray, dense: torch.Tensor) -> kernels.ExactBlocks | None:
    """The blocks `raw` of GGUF type `kind` as an exact matrix for `dense`, or None (another type, or
    blocks that do not rebuild `dense` bit for bit)."""
    if kind not in _FORMATS or dense.dtype != torch.float32 or dense.ndim != 2 or dense.shape[1] % BLOCK:
        return None
    parts, matrix = _FORMATS[kind]
    values, scale = parts(raw, *dense.shape)
    return matrix.build(values, scale, dense.detach().contiguous())


# GGUF metadata value types: fixed sizes in bytes; 8 is a string, 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_TYPES = {12: "Q4_K", 14: "Q6_K"}  # ggml type ids of the formats read here


def tensor_blocks(path: str | Path) -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF tensor name: (type name, raw bytes)} for the Q4_K / Q6_K tensors of a GGUF file (memory-mapped).

    Reads only the tensor index: the metadata (a 150k-token vocabulary) is skipped, not decoded."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    view = memoryview(data)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from(fmt, view, pos)
        pos += struct.calcsize(fmt)
        return value[0]

    def string() -> str:
        nonlocal pos
        length = take("<Q")
        pos += length
        return bytes(view[pos - length:pos]).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            length = take("<Q")
            pos += length
        elif kind == 9:
            inner, count = take("<I"), take("<Q")
            if inner in _SIZES:
                pos += _SIZES[inner] * count
            else:
                for _ in range(count):
                    skip(inner)
        else:
            pos += _SIZES[kind]

    if bytes(view[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    version, tensors, fields = take("<I"), take("<Q"), take("<Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
    alignment = 32
    for _ in range(fields):
        key, kind = string(), take("<I")
        if key == "general.alignment" and kind == 4:
            alignment = take("<I")
        else:
            skip(kind)
    index = []
    for _ in range(tensors):
        name, dims = string(), take("<I")
        shape = [take("<Q") for _ in range(dims)]
        kind, offset = take("<I"), take("<Q")
        index.append((name, shape, kind, offset))
    start = -(-pos // alignment) * alignment
    found = {}
    for name, shape, kind, offset in index:
        if kind in _TYPES:
            weights = int(np.prod(shape))
            size = weights // BLOCK * (Q4_K_BYTES if kind == 12 else Q6_K_BYTES)
            found[name] = (_TYPES[kind], data[start + offset:start + offset + size])
    return found
