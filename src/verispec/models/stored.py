"""A model's quantized matrices kept on disk, so that a new process reads them instead of making them.

Two kinds. `drafter="self"` drafts with an int4 copy of the target's own matrices
(`NativeCausalLM.lower_precision_copy`, `int4_copy` here): making it for the 1.5B target takes ~3 s (undo the
panel layout, quantize ~1.3 billion weights). A draft model loaded with `weight_dtype="q4_0"` or `"q3_0"` (the
default beside a q8 target) has its matrices rounded to 32-weight blocks at load (`converted` here): for the 0.5B
draft ~2 s of Q4_0 rounding and ~8 s of the 3-bit blocks' scale search, on every start of a server or CLI. Reading
either back from the page cache takes a fraction of that. A stored copy is named by a fingerprint of the source
matrices (shapes, a checksum of every value and a strided sample) and of the quantizer's settings, so changed
weights or a changed quantizer never meet an old copy. Even if one did, only drafting would suffer: the target
still verifies every token.

Layout under the zoo's `home()`: `copies/<model>-<kind>-<fingerprint>.safetensors` (kind: int4, q4_0, q3_0),
written to a temporary file and renamed, so a reader never sees half a copy; storing one removes the copies of
other weights of that kind stored under the same model name. Copies of small models (under `STORE_MIN_WEIGHTS`)
are quick to make and are not stored; `KernelConfig.store_copies` (`VERISPEC_STORE_COPIES=0`) turns storing and reading off.

This module knows nothing about drafting; it hands a model its matrices.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import time
import weakref
from pathlib import Path

import torch

from verispec.models import kernels

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the stored tensors change meaning
BLOCKS_FORMAT = 2  # the same for the 32-weight blocks (bump when `GGUFMatrix.quantize` rounds differently)
INT4 = "int4"
STORE_MIN_WEIGHTS = 200_000_000  # below this the copy is made in well under a second: not worth 0.56 bytes/weight on disk
_SAMPLES = 4096  # values per matrix in the fingerprint's strided sample


def enabled() -> bool:
    return kernels.config.current().store_copies


def _float32_values(matrix) -> torch.Tensor:
    """The float32 numbers a matrix is kept as (in whatever layout this model keeps them)."""
    if isinstance(matrix, kernels.ExactBlocks):
        return matrix.dense
    if isinstance(matrix, kernels.PanelMatrix):
        return matrix.values
    if isinstance(matrix, kernels.GGUFMatrix):  # the file's bytes stand for its weights: read them as float32 bit patterns
        flat = matrix.values.reshape(-1)
        return flat[: flat.numel() // 4 * 4].view(torch.float32)
    return matrix


def _settings(kind: str, types: tuple[int, ...] = ()) -> str:
    """What a copy of `kind` was made with, beside the weights: the format and the quantizer's settings (for
    blocks, each matrix's block type, in `model.matrices()` order)."""
    if kind == INT4:
        return f"int4 format {FORMAT} group {kernels.Int4Matrix.GROUP} shrinks {kernels.Int4Matrix.SHRINKS.tolist()}"
    return f"{kind} blocks format {BLOCKS_FORMAT} types {list(types)}"


def fingerprint(model, kind: str = INT4, types: tuple[int, ...] = ()) -> str:
    """Hex digest naming `model`'s copy of `kind`: every matrix's shape, the sum of its float32 bit patterns, a
    strided sample of its values, and the quantizer's settings."""
    digest = hashlib.sha256(_settings(kind, types).encode())
    for matrix in model.matrices():
        values = _float32_values(matrix).detach().contiguous()
        flat = values.view(-1)
        bits = flat.view(torch.int32)
        sample = flat[torch.arange(_SAMPLES, dtype=torch.int64) * (flat.numel() - 1) // (_SAMPLES - 1)]  # ends included
        # the bit patterns' sum modulo 2**32: any one changed weight changes it (and integer sums are fast)
        digest.update(f"{tuple(matrix.shape)} {tuple(values.shape)} {int(bits.sum(dtype=torch.int32))}".encode())
        digest.update(sample.cpu().numpy().tobytes())
    return digest.hexdigest()[:24]


# Each model object's int4 fingerprint, computed once (~0.3 s for the 1.5B): weights edited in place after that
# would keep the old name, which could only cost drafting speed.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fingerprint_of(model) -> str:
    key = _FINGERPRINTS.get(model)
    if key is None:
        key = _FINGERPRINTS[model] = fingerprint(model)
    return key


def _slug(model) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(model.name)).strip("_")[-80:] or "model"


def _directory() -> Path:
    from verispec.zoo import home

    return home() / "copies"


def path_for(model, key: str, kind: str = INT4) -> Path:
    return _directory() / f"{_slug(model)}-{kind}-{key}.safetensors"


def _stored_under(model, kind: str = INT4) -> list[Path]:
    """The copies of `kind` stored under this model's name, for whatever weights."""
    directory = _directory()
    if not directory.is_dir():
        return []
    name = re.compile(re.escape(_slug(model)) + "-" + re.escape(kind) + r"-[0-9a-f]{24}\.safetensors")
    return [path for path in directory.iterdir() if name.fullmatch(path.name)]


def has_copy(model) -> bool:
    """Whether a stored copy of these very weights is on disk (no fingerprint is computed unless some copy
    under this model's name is)."""
    if not _worth_storing(model):
        return False
    if not _stored_under(model):
        return False
    return path_for(model, _fingerprint_of(model)).exists()


def _worth_storing(model) -> bool:
    return enabled() and sum(m.shape[0] * m.shape[1] for m in model.matrices()) >= STORE_MIN_WEIGHTS


def _load(path: Path, kind: str) -> dict | None:
    from safetensors.torch import load_file

    if not path.exists():
        return None
    try:
        return load_file(path)
    except Exception as exc:  # noqa: BLE001 -- any unreadable file (truncated, foreign, corrupt) is made again
        log.warning("ignoring the stored %s copy %s (%s): making it again", kind, path, exc)
        return None


def _stored_matrix(tensors: dict, i: int, source, block_type: int | None):
    """Matrix i of a stored copy, shaped for `source` (an `Int4Matrix`, or with a block type a `GGUFMatrix` of it), or
    None if the file's tensors for it are missing or do not fit."""
    n, k = source.shape
    if block_type is not None:
        _, size, weights, _ = kernels.GGUFMatrix.KINDS[block_type]
        blocks = tensors.get(f"{i}.blocks")
        if blocks is None or blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, k // weights * size):
            return None
        return kernels.GGUFMatrix(blocks, block_type)
    values, scale = tensors.get(f"{i}.values"), tensors.get(f"{i}.scale")
    if (values is None or scale is None or values.dtype != torch.uint8 or scale.dtype != torch.float32
            or tuple(values.shape) != (n, k // 2) or tuple(scale.shape) != (n, k // kernels.Int4Matrix.GROUP)):
        return None
    return kernels.Int4Matrix(values.to(source.device), scale.to(source.device))


def _read(model, path: Path, kind: str = INT4, types: tuple[int, ...] = ()) -> list | None:
    """The stored matrices, in `model.matrices()` order (int4, or blocks of `types`), or None if the file is missing
    or does not fit."""
    tensors = _load(path, kind)
    if tensors is None:
        return None
    stored = []
    sources = model.matrices()
    for i, (source, block_type) in enumerate(zip(sources, types or [None] * len(sources), strict=True)):
        matrix = _stored_matrix(tensors, i, source, block_type)
        if matrix is None:
            log.warning("ignoring the stored %s copy %s: matrix %d does not fit %s; making it again",
                        kind, path, i, model.name)
            return None
        stored.append(matrix)
    needed = (1 if types else 2) * len(stored)
    if len(tensors) != needed:
        log.warning("ignoring the stored %s copy %s: it holds %d tensors, %s needs %d; making it again",
                    kind, path, len(tensors), model.name, needed)
        return None
    return stored


def _tensors(matrices) -> dict[str, torch.Tensor]:
    tensors = {}
    for i, matrix in enumerate(matrices):
        if isinstance(matrix, kernels.GGUFMatrix):
            tensors[f"{i}.blocks"] = matrix.blocks.cpu()
        else:
            tensors[f"{i}.values"], tensors[f"{i}.scale"] = matrix.values.cpu(), matrix.scale.cpu()
    return tensors


def _write(matrices: list, path: Path, copy_of, kind: str = INT4) -> None:
    """Store a copy's `matrices` (in `matrices()` order) at `path`, replacing any copy of `kind` of other weights
    stored under `copy_of`'s name (one copy per model name and kind keeps the store from growing with every
    re-pulled or edited model)."""
    from safetensors.torch import save_file

    tensors = _tensors(matrices)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        form = FORMAT if kind == INT4 else BLOCKS_FORMAT
        save_file(tensors, partial, metadata={"format": str(form), "source": str(copy_of.name)})
        os.replace(partial, path)
        for older in _stored_under(copy_of, kind):  # copies of earlier weights under this name
            if older != path:
                older.unlink(missing_ok=True)
        for left in path.parent.glob(f".{_slug(copy_of)}-{kind}-*.partial"):  # from writers that died an hour ago or more
            if time.time() - left.stat().st_mtime > 3600:
                left.unlink(missing_ok=True)
    except OSError as exc:  # a full or read-only disk: the copy still works, from memory
        log.warning("could not store the %s copy of %s at %s (%s); it will be made again next time",
                    kind, copy_of.name, path, exc)
        with contextlib.suppress(OSError):
            partial.unlink()


def int4_copy(model):
    """`model.lower_precision_copy(torch.quint4x2)`, read from disk when a stored copy of these very weights
    exists, else made (and stored, for models of `STORE_MIN_WEIGHTS` weights or more)."""
    if not _worth_storing(model):
        log.info("making an int4 copy of %s to draft with", model.name)
        return model.lower_precision_copy(torch.quint4x2)
    started = time.perf_counter()
    path = path_for(model, _fingerprint_of(model))
    stored = _read(model, path)
    if stored is not None:
        copy = model.lower_precision_copy(torch.quint4x2, matrices=stored)
        log.info("int4 copy of %s read from %s in %.1f s", model.name, path, time.perf_counter() - started)
        return copy
    log.info("making an int4 copy of %s to draft with (once: it is stored for the next runs)", model.name)
    copy = model.lower_precision_copy(torch.quint4x2)
    made = time.perf_counter()
    _write(copy.matrices(), path, model)
    log.info("int4 copy of %s made in %.1f s, stored at %s in %.1f s", model.name, made - started, path, time.perf_counter() - made)
    return copy


def converted(model, kind: str, types: tuple[int, ...]) -> list:
    """`model.matrices()` rounded to 32-weight blocks, matrix i to `GGUFMatrix` type types[i] (`GGUFMatrix.quantize`,
    each block's scale searched: a draft's blocks need not be the bytes llama-quantize would write), read from disk
    when a stored copy of these very weights exists, else made (and stored, for models of `STORE_MIN_WEIGHTS`
    weights or more). kind names the copy (q4_0, q3_0)."""
    def make() -> list:
        from tqdm import tqdm

        # seconds of work on a first load (a 0.5B: ~10): a bar where a person watches (a terminal), nothing otherwise
        pairs = tqdm(list(zip(model.matrices(), types, strict=True)), desc=f"rounding {model.name} to {kind} blocks",
                     unit="matrix", file=sys.stderr, disable=None, leave=False)
        return [kernels.GGUFMatrix.quantize(matrix, block_type, search=True) for matrix, block_type in pairs]

    if not _worth_storing(model):
        return make()
    started = time.perf_counter()
    path = path_for(model, fingerprint(model, kind, types), kind)
    stored = _read(model, path, kind, types)
    if stored is not None:
        log.info("%s blocks of %s read from %s in %.1f s", kind, model.name, path, time.perf_counter() - started)
        return stored
    log.info("rounding %s to %s blocks (once: they are stored for the next runs)", model.name, kind)
    matrices = make()
    made = time.perf_counter()
    _write(matrices, path, model, kind)
    log.info("%s blocks of %s made in %.1f s, stored at %s in %.1f s",
             kind, model.name, made - started, path, time.perf_counter() - made)
    return matrices
