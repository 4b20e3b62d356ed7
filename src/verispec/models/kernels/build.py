"""Compiling the C kernels (`verispec/csrc/`) into one shared library, once per source hash, cached.

The vector sources are compiled once per ISA, selecting their mapping header by a define (see
csrc/simd.h), and the rest once, each with the instruction set its code is written for; all the
objects link into one library whose exported names are those of csrc/kernels.h. The sources are
compiled where they lie, so a compiler message names the real file and line. The library's name
carries a hash of every csrc file and of the flags: an edit rebuilds it, an unchanged tree reuses it.
This module knows nothing about what the kernels compute.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"

FLAGS = ("-O3", "-fPIC", "-pthread", "-ffp-contract=off", "-fvisibility=hidden", "-Wall", "-Wextra")
LIBS = ("-lm",)
AVX512 = ("-DVS_ISA_AVX512", "-mavx512f")
AVX2 = ("-DVS_ISA_AVX2", "-mavx2", "-mfma")
AVX2_ONLY = ("-mavx2", "-mfma")
VNNI_ONLY = ("-mavx512f", "-mavx512bw", "-mavx512vnni")
Q8_512 = ("-DVS_Q8_512", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c")
Q8_256 = ("-DVS_Q8_256", "-mavx2", "-mfma", "-mf16c")
AMX = (*Q8_512, "-mamx-tile", "-mamx-int8")

# Each source with the instruction-set flags of each object made from it. Baseline code (no flags)
# runs before anything has checked the CPU; the rest runs only once kernels_isa() allowed it.
UNITS: dict[str, tuple[tuple[str, ...], ...]] = {
    "pool.c": ((),),
    "dispatch.c": ((),),
    "layer.c": ((),),
    "kquant.c": (AVX2_ONLY,),
    "blocked.c": (AVX2_ONLY,),
    "panels.c": (AVX2_ONLY,),
    "int4_avx2.c": (AVX2_ONLY,),
    "int4_vnni.c": (VNNI_ONLY,),
    "kquant_q8.c": (Q8_512, Q8_256),
    "quant32_q8.c": (Q8_512, Q8_256),
    "kquant_amx.c": (AMX,),
    "kquant_q8_pack.c": ((),),
    "quant32_q8_pack.c": ((),),
    "kquant_rows.c": ((),),
    **{vector: (AVX512, AVX2) for vector in ("linear.c", "int4.c", "exact.c", "norms.c", "attention.c")},
}


class BuildError(OSError):
    """The kernels could not be built here (no compiler, or it failed: the message holds its output)."""


def compiler(configured: str | None = None) -> str:
    found = configured or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise BuildError("no C compiler (cc/gcc) on PATH; set CC to one")
    return found


def _objects() -> list[tuple[Path, tuple[str, ...], str]]:
    """(source, flags, object name) for every object of the library."""
    objects = []
    for name, variants in UNITS.items():
        for flags in variants:
            isa = "_512" if flags in (AVX512, Q8_512) else "_256" if flags in (AVX2, Q8_256) else ""
            objects.append((CSRC / name, flags, f"{Path(name).stem}{isa}.o"))
    return objects


def source_hash() -> str:
    """A hash of every file of the C tree and of every flag the build uses."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr((FLAGS, LIBS, sorted(UNITS.items()))).encode())
    return digest.hexdigest()[:16]


KEPT_BUILDS = 4  # libraries of different sources kept side by side


def build(directory: Path, cc: str | None = None) -> Path:
    """The library for the current sources in `directory` (built now unless already there)."""
    target = directory / f"kernels_{source_hash()}.so"
    if target.exists():
        os.utime(target)  # recently used: kept when other builds are evicted
        return target
    cc = compiler(cc)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        objects = [str(Path(tmp) / name) for _, _, name in _objects()]
        _run([[cc, *FLAGS, *flags, "-c", str(source), "-o", obj] for (source, flags, _), obj in zip(_objects(), objects)])
        built = Path(tmp) / target.name
        _run([[cc, "-shared", "-pthread", *objects, "-o", str(built), *LIBS]])
        os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
    evict_other_builds(directory, target)
    return target


def evict_other_builds(directory: Path, current: Path) -> None:
    """Keep `current` and the builds of other sources used last, KEPT_BUILDS in all, and delete the rest: two
    checkouts of different versions on one machine would otherwise rebuild on every start, each evicting the
    other's. Unlinking is safe while another process has a library mapped."""
    others = sorted((b for b in directory.glob("kernels_*.so") if b != current), key=lambda b: b.stat().st_mtime, reverse=True)
    for stale in others[KEPT_BUILDS - 1:]:
        stale.unlink(missing_ok=True)


def _run(commands: list[list[str]]) -> None:
    """Run the commands, as many at once as there are cores; raise the first failure's output."""
    running: list[subprocess.Popen] = []
    failures: list[str] = []
    for command in [*commands, None]:
        while running and (command is None or len(running) >= (os.cpu_count() or 1)):
            job = running.pop(0)
            out, err = job.communicate()
            if job.returncode:
                failures.append(f"{' '.join(job.args)}\n{err or out}")
        if command is not None:
            running.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    if failures:
        raise BuildError(failures[0])
