"""A GGUF file run with llama.cpp's numerics, straight from its own blocks (`numerics="q8"`).

`load(path)` builds a `NativeCausalLM` from the file itself, no transformers model and no float32
conversion: the file is memory-mapped, every quantized matrix (the LM head and, when tied, the
embedding included) keeps the file's blocks (`kernels.GGUFMatrix`), and only the small float tensors
(norms, biases) are read as they are. The kernels read each matrix's blocks repacked at load, 16
output columns interleaved (the same codes and scales, 0-3% more bytes: csrc/kquant_q8_pack.c, a
single pass over the file); the file's pages are then let go, and only the embedding rows a pass looks
up are read from it again (the table stays quantized: a pass dequantizes the rows of its tokens). So
a model occupies about its file's size in memory and starts in about the time it takes to read the
file once.

The numbers are llama.cpp's, not the float32 model's: every activation row entering a matrix is
rounded to 8 bits as ggml rounds it for the matrix's type (per 256 as Q8_K for Q4_K / Q5_K / Q6_K, per
32 as llama.cpp's x86 Q8_0 / Q8_1 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0), and the products are integer dot products against
the blocks (see `kernels.GGUFMatrix`, csrc/kquant_q8.c and csrc/quant32_q8.c). The rest of the pass (RMSNorm, RoPE,
attention, SwiGLU) is verispec's float32 kernels, where llama.cpp has its own float32 ops (and F16
key/value caches by default), so logits agree with llama.cpp's closely but not bit for bit. What
speculation needs holds exactly: each token row's logits are bitwise the same at any pass width,
so greedy speculative decoding gives exactly the plain greedy tokens of this target. Prefill runs
the same kernels in chunks of `kernels.Q8_MAX_ROWS` tokens.

Reads Llama and Qwen2 files whose matrices are Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 (e.g. Q4_K_M,
Q5_K_M, Q6_K, Q4_0, Q4_1, Q8_0 files, and the Q5_0 / Q8_0 matrices a K-quant file holds where a row's length is
not a multiple of 256); other types raise `VerispecError` (use the default float32 numerics for them).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.models import kernels
from verispec.models.native import MATRIX_FIELDS, NativeCausalLM, _Layer

NUMERICS = ("float32", "q8")  # what `verispec.load(..., numerics=)` takes

# ggml type ids: bytes per block and weights per block
_TYPES = {0: ("F32", 4, 1), 1: ("F16", 2, 1), 2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32), 6: ("Q5_0", 22, 32),
          7: ("Q5_1", 24, 32), 8: ("Q8_0", 34, 32), 10: ("Q2_K", 84, 256), 11: ("Q3_K", 110, 256),
          12: ("Q4_K", 144, 256), 13: ("Q5_K", 176, 256), 14: ("Q6_K", 210, 256), 30: ("BF16", 2, 1)}
# GGUF metadata value types: struct formats of the scalars; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass
class Tensor:
    kind: int  # ggml type id
    shape: tuple[int, ...]  # rows first: [N, K] for a matrix (GGUF lists dimensions innermost first)
    raw: np.ndarray  # its bytes in the memory-mapped file


def read(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(metadata, tensors) of a GGUF file: the metadata's scalars and strings (arrays are skipped: the
    vocabulary alone is 150k strings) and every tensor as a view of the memory-mapped file."""
    data = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, pages shared with the page cache
    view = memoryview(data)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from(fmt, view, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        length = take("<Q")
        pos += length
        return bytes(view[pos - length:pos]).decode("utf-8", "replace")

    def value(kind: int):
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = take("<I"), take("<Q")
            if inner in _SCALARS:
                pos += struct.calcsize(_SCALARS[inner]) * count
            else:
                for _ in range(count):
                    value(inner)
            return None
        return take(_SCALARS[kind])

    if len(data) < 24 or bytes(view[:4]) != b"GGUF":
        raise VerispecError(f"{path} is not a GGUF file")
    pos = 4
    version, count, fields = take("<I"), take("<Q"), take("<Q")
    if version < 2:
        raise VerispecError(f"{path}: GGUF version {version} is not supported (2 or later)")
    metadata = {}
    for _ in range(fields):
        key = string()
        metadata[key] = value(take("<I"))
    index = []
    for _ in range(count):
        name, dims = string(), take("<I")
        shape = tuple(take("<Q") for _ in range(dims))
        index.append((name, shape[::-1], take("<I"), take("<Q")))
    alignment = metadata.get("general.alignment") or 32
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in index:
        if kind not in _TYPES:
            raise VerispecError(f"{path}: tensor {name} has ggml type {kind}, which verispec does not read")
        _, size, per_block = _TYPES[kind]
        nbytes = int(np.prod(shape)) // per_block * size
        raw = data[start + offset:start + offset + nbytes]
        tensors[name] = Tensor(kind, shape, raw.reshape(shape[0], -1) if len(shape) == 2 else raw)
    return metadata, tensors


def _floats(tensor: Tensor, name: str) -> torch.Tensor:
    """A small float tensor (a norm or a bias) as float32."""
    if tensor.kind == 0:
        return torch.from_numpy(tensor.raw.view(np.float32).reshape(tensor.shape))
    if tensor.kind == 1:
        return torch.from_numpy(tensor.raw.view(np.float16).astype(np.float32).reshape(tensor.shape))
    raise VerispecError(f"{name} is {_TYPES[tensor.kind][0]}: expected a float32 or float16 vector")


def _matrix(tensor: Tensor, name: str, rows: np.ndarray | None = None) -> kernels.GGUFMatrix:
    """A quantized matrix of the file (a `kernels.GGUFMatrix` type) as the kernels multiply it (rows reordered if `rows` is given: a copy)."""
    if tensor.kind not in kernels.GGUFMatrix.KINDS:
        raise VerispecError(
            f"{name} is {_TYPES[tensor.kind][0]}: numerics='q8' multiplies Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and "
            "Q8_0 blocks (Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 files); load this file with "
            "the default float32 numerics")
    values = torch.from_numpy(tensor.raw)
    return kernels.GGUFMatrix(values if rows is None else values[torch.from_numpy(rows)].contiguous(), tensor.kind)


def _let_go_of_file_pages(raw: np.ndarray) -> None:
    """Tell the kernel this process no longer needs the mapped file's pages (MADV_DONTNEED): the products
    read their repacked copies, so the file's pages need not count in the process's memory beside them.
    The mapping is private and never written, so a later read (an embedding row) reads the file again."""
    mapped = getattr(raw, "_mmap", None)  # np.memmap views share their file's mmap
    if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order undoing llama.cpp's converter, which interleaves each Llama head's q/k rows for its
    pairwise RoPE: verispec rotates halves, as transformers (whose GGUF loader undoes the same)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def _config(metadata: dict, vocab_size: int):
    """A transformers config describing the file's model (for code that reads `model.config`)."""
    from transformers import LlamaConfig, Qwen2Config

    arch = metadata.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise VerispecError(f"numerics='q8' runs Llama and Qwen2 GGUF files, not {arch!r}")

    def get(key: str, default=None):
        found = metadata.get(f"{arch}.{key}", default)
        if found is None and key not in ("rope.scaling.type", "attention.head_count_kv"):
            raise VerispecError(f"the GGUF file has no {arch}.{key}: not a model file verispec can run")
        return found

    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise VerispecError(f"RoPE scaling {scaling!r} is not supported with numerics='q8'")
    heads = int(get("attention.head_count"))
    config = (LlamaConfig if arch == "llama" else Qwen2Config)(
        vocab_size=vocab_size, hidden_size=int(get("embedding_length")), intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv") or heads), max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings=True)
    return config


def _tokenizer(path: Path):
    """The file's tokenizer: a converted directory's beside it (the zoo keeps `hf/` next to the .gguf),
    else transformers' reading of the GGUF's vocabulary (slower: it parses every token)."""
    from transformers import AutoTokenizer

    beside = path.parent / "hf"
    try:
        if (beside / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(beside), beside
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), None
    except (OSError, ValueError):
        return None, None


def _eos_ids(metadata: dict, tokenizer, directory: Path | None) -> frozenset[int]:
    ids = set()
    if isinstance(metadata.get("tokenizer.ggml.eos_token_id"), int):
        ids.add(metadata["tokenizer.ggml.eos_token_id"])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:  # the generation config of a converted directory may name more (Qwen's chat models: two)
        found = json.loads((directory / "generation_config.json").read_text()).get("eos_token_id")
        ids.update([found] if isinstance(found, int) else found or ())
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return frozenset(ids)


def load(path: str | Path, tokenizer=None, name: str | None = None) -> NativeCausalLM:
    """A native model running the GGUF file at `path` with llama.cpp's numerics (see the module docstring).

    tokenizer: used as given; by default the one of a converted directory beside the file, else read
    from the file. Raises VerispecError for a file it cannot run this way."""
    path = Path(path)
    if not kernels.available():
        raise VerispecError("numerics='q8' needs verispec's C kernels (a C compiler and an AVX2 CPU)")
    metadata, tensors = read(path)
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise VerispecError(f"{path} has no token_embd.weight: not a decoder GGUF verispec can run")
    config = _config(metadata, embedding.shape[0])
    directory = None
    if tokenizer is None:
        tokenizer, directory = _tokenizer(path)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    llama = metadata.get("general.architecture") == "llama"

    def matrix(key: str, permute_heads: int | None = None):
        if key not in tensors:
            raise VerispecError(f"{path} has no tensor {key}")
        rows = _unpermute_rows(tensors[key].shape[0], permute_heads) if llama and permute_heads else None
        return _matrix(tensors[key], key, rows)

    def floats(key: str, required: bool = True):
        if key not in tensors:
            if required:
                raise VerispecError(f"{path} has no tensor {key}")
            return None
        return _floats(tensors[key], key)

    model = NativeCausalLM.__new__(NativeCausalLM)
    model.config = config
    model.tokenizer = tokenizer
    model.name = name or metadata.get("general.name") or path.stem
    model.eos_token_ids = _eos_ids(metadata, tokenizer, directory)
    model._hf_model = lambda: None  # no transformers model behind this one
    model.max_context = config.max_position_embeddings
    if embedding.kind in kernels.GGUFMatrix.KINDS:
        model.embed = _matrix(embedding, "token_embd.weight")  # looked up row by row, dequantized
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        model.embed = torch.from_numpy(np.ascontiguousarray(dequantize(embedding.raw, GGMLQuantizationType(embedding.kind)),
                                                            dtype=np.float32))
    if "output.weight" in tensors:
        model.lm_head = matrix("output.weight")
    else:  # tied: the embedding's blocks are the head's
        model.lm_head = model.embed if isinstance(model.embed, kernels.GGUFMatrix) else _matrix(embedding, "token_embd.weight")
    model.lm_head_bias = None
    model.final_norm = floats("output_norm.weight")
    model.device, model.dtype = torch.device("cpu"), torch.float32
    model.vocab_size = int(model.lm_head.shape[0])
    model.hidden_size = config.hidden_size
    model.num_heads, model.num_kv_heads = heads, kv_heads
    model.head_dim = config.hidden_size // heads
    model.eps = float(config.rms_norm_eps)
    model.scale = model.head_dim ** -0.5
    model.layers = []
    names = {"q": ("attn_q", heads), "k": ("attn_k", kv_heads), "v": ("attn_v", None), "o": ("attn_output", None),
             "gate": ("ffn_gate", None), "up": ("ffn_up", None), "down": ("ffn_down", None)}
    for i in range(config.num_hidden_layers):
        parts = {"attn_norm": floats(f"blk.{i}.attn_norm.weight"), "mlp_norm": floats(f"blk.{i}.ffn_norm.weight")}
        for field in MATRIX_FIELDS:
            key, permute = names[field]
            parts[field] = matrix(f"blk.{i}.{key}.weight", permute)
            bias = floats(f"blk.{i}.{key}.bias", required=False)
            if bias is not None and llama and permute:
                bias = bias[torch.from_numpy(_unpermute_rows(bias.shape[0], permute))]
            parts[f"{field}_bias"] = None if bias is None else bias.contiguous()
        model.layers.append(_Layer(**parts))
    model.numerics = "q8"
    dim = model.head_dim
    theta = float(metadata.get(f"{metadata['general.architecture']}.rope.freq_base", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    model._finish_init(None, False, inv_freq, 1.0)
    if not model._kernels:
        raise VerispecError(f"{model.name}: the q8 kernels cannot run this model (head size {dim} is not a multiple "
                            f"of {kernels.lanes()}?)")
    _let_go_of_file_pages(embedding.raw)
    return model
