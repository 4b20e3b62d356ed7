"""What runs here: the kernel library, loaded once, and the ISA and int4 path that the CPU and the
configuration (`config.current()`) choose. Every call into the library goes through `runtime()`."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from verispec.models.kernels import abi, build, config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Library:
    lib: ctypes.CDLL
    isa: int  # the widest ISA the CPU runs: 512, 256 (0: none, the library unusable)
    vnni: bool  # the CPU has AVX-512 VNNI


@dataclass(frozen=True)
class Runtime:
    """The library and the choices a call passes to it. `lib` is None when the kernels do not run here."""

    lib: ctypes.CDLL | None
    isa: int  # 512, 256, or 0 when unavailable
    int4_format: abi.Format  # INT4 (float activations), INT4_VNNI or INT4_AVX2 (int8 activations)
    config: config.KernelConfig
    amx: bool = False  # wide Q4_K and Q6_K q8 passes on AMX tiles (the library's switch, set when this runtime was made)


# Rows from which a q8 target's Q4_K and Q6_K products run on AMX tiles where the CPU has them (`amx()`): below it the VNNI
# tiles, whose 8 rows share a sub-block decoded in registers, are as fast (bench/README.md).
AMX_MIN_ROWS = 16

_library: _Library | None = None
_tried = False
_runtime: Runtime | None = None


def _cache_dir():
    from verispec.zoo import home

    return home() / "kernels"


def _load(cfg: config.KernelConfig) -> _Library | None:
    """The library, built if need be on the first call; None without a compiler or a suitable CPU."""
    global _library, _tried
    if not _tried:
        _tried = True
        try:
            library = abi.bind(ctypes.CDLL(str(build.build(_cache_dir(), cfg.compiler))))
        except OSError as exc:  # BuildError included: its message holds the compiler's, file and line
            log.warning("verispec: C kernels unavailable, small passes use PyTorch (%s)", str(exc).strip()[:4000])
            return None
        isa = library.kernels_isa()
        _library = _Library(library, isa, bool(isa == 512 and library.kernels_vnni())) if isa else None
    return _library


def runtime() -> Runtime:
    """The runtime for the configuration in force (recomputed when it changes)."""
    global _runtime
    cfg = config.current()
    if _runtime is None or _runtime.config is not cfg:
        library = _load(cfg) if cfg.enabled else None
        if library is None:
            _runtime = Runtime(None, 0, abi.Format.INT4, cfg)
        else:
            isa = cfg.isa if cfg.isa and cfg.isa <= library.isa else library.isa
            if not cfg.int8_activations:
                int4 = abi.Format.INT4  # unpack nibbles to float
            elif isa == 512 and library.vnni and cfg.vnni:
                int4 = abi.Format.INT4_VNNI
            else:
                int4 = abi.Format.INT4_AVX2
            amx = bool(library.lib.kernels_amx(AMX_MIN_ROWS if cfg.amx and isa == 512 and library.vnni and cfg.vnni else 0))
            _runtime = Runtime(library.lib, isa, int4, cfg, amx)
    return _runtime


def available() -> bool:
    """Whether the kernels run here (C compiler present, CPU with AVX2+FMA or AVX-512, not turned off)."""
    return runtime().lib is not None


def isa() -> int:
    """Vector width in bits the kernels use: 512, 256, or 0 when unavailable."""
    return runtime().isa


def lanes() -> int:
    """Floats per vector: head sizes must be a multiple of this for `slot_attention`."""
    return 16 if isa() == 512 else 8


def amx() -> bool:
    """Whether a q8 target's wide Q4_K and Q6_K passes (16 rows and more) run on AMX tiles: bitwise what the VNNI tiles give."""
    return runtime().amx


def vnni() -> bool:
    """Whether int4 matrices multiply int8-rounded activations with AVX-512 VNNI."""
    return runtime().int4_format == abi.Format.INT4_VNNI


def check(*tensors) -> Runtime:
    """The runtime, after checking that the kernels run here and take these tensors."""
    found = runtime()
    if found.lib is None:
        raise RuntimeError("verispec C kernels unavailable here: check kernels.available() and use PyTorch ops")
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the kernels take contiguous float32 CPU tensors")
    return found
