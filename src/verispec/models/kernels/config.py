"""The kernels' switches: one frozen `KernelConfig`, read from the environment once, held here.

Every switch that changes which kernel runs (and so, for some, the numbers) is a field below; the
rest of verispec reads them from `current()`, never from `os.environ`. An embedding application or
a test sets another configuration with `configure(KernelConfig(...))` (or
`dataclasses.replace(current(), ...)`), and gets the previous one back.

| field              | environment                                   | default | effect |
| ------------------ | --------------------------------------------- | ------- | ------ |
| `enabled`          | `VERISPEC_NO_KERNELS=1` turns off             | on      | the C kernels at all; off, every pass runs PyTorch ops |
| `isa`              | `VERISPEC_KERNEL_ISA=256`                     | widest  | cap the vector ISA (512: AVX-512, 256: AVX2+FMA) below what the CPU runs (tests, comparisons) |
| `int8_activations` | `VERISPEC_INT4_FLOAT=1` or `VERISPEC_NO_VNNI=1` turn off | on | int4 matrices multiply activations rounded to int8 per group of 64 (VNNI or AVX2 byte products); off: unpacked weights x float32 activations |
| `vnni`             | none                                          | on      | use AVX-512 VNNI for those int8 products where the CPU has it; off: the AVX2 byte-product kernel (tests) |
| `amx`              | `VERISPEC_KERNEL_AMX=0` turns off             | on      | wide Q4_K and Q6_K passes of a q8 target (prefill) on AMX tiles where the CPU has them; the same bits as without |
| `torch_gemm`       | `VERISPEC_TORCH_GEMM=1`                       | off     | big passes (prefill) keep PyTorch's GEMM on AVX2 CPUs instead of `blocked_linear` |
| `panels`           | `VERISPEC_PANELS=0` turns off                 | on      | float32 matrices kept as `PanelMatrix` where the blocked GEMM is preferred |
| `fused_layers`     | `VERISPEC_LAYER_LOOP=1` turns off             | on      | a small pass runs every decoder layer in one C call; off: a Python loop over the same kernels (bitwise equal) |
| `chunked_prefill`  | `VERISPEC_CHUNKED_PREFILL=1`                  | off     | int4 drafts with int8 activations prefill in small passes also where PyTorch's GEMM would prefill |
| `wide_prefill`     | `VERISPEC_WIDE_PREFILL=1`                     | off     | never prefill in small-pass chunks |
| `store_copies`     | `VERISPEC_STORE_COPIES=0` (or `false`, `no`, empty) turns off | on | store made int4 self-draft copies and drafts' Q4_0 / Q3_0 blocks in the cache and read them back |
| `huge_pages`       | `VERISPEC_HUGE_PAGES=0` (or `false`, `no`, empty) turns off | on | the quantized matrices' repacked blocks on 2 MB pages where Linux gives them (`kernels.pages`) |
| `compiler`         | `CC`                                          | `cc`, else `gcc` on PATH | the C compiler that builds the kernels |

A flag set to any non-empty value counts as set, except where the table names the values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from verispec.errors import VerispecError

ISAS = (512, 256)


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels run: see the module's table for each field and its environment variable."""

    enabled: bool = True
    isa: int | None = None  # None: the widest the CPU runs
    int8_activations: bool = True
    vnni: bool = True
    amx: bool = True
    torch_gemm: bool = False
    panels: bool = True
    fused_layers: bool = True
    chunked_prefill: bool = False
    wide_prefill: bool = False
    store_copies: bool = True
    huge_pages: bool = True
    compiler: str | None = None

    def __post_init__(self):
        if self.isa is not None and self.isa not in ISAS:
            raise VerispecError(f"kernel ISA {self.isa} unknown: use 512 (AVX-512) or 256 (AVX2+FMA)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "KernelConfig":
        """The configuration the environment variables of the module's table describe."""
        isa = environ.get("VERISPEC_KERNEL_ISA")
        if isa and not isa.isdigit():
            raise VerispecError(f"VERISPEC_KERNEL_ISA={isa!r}: use 512 (AVX-512) or 256 (AVX2+FMA)")
        return cls(
            enabled=not environ.get("VERISPEC_NO_KERNELS"),
            isa=int(isa) if isa else None,
            int8_activations=not (environ.get("VERISPEC_INT4_FLOAT") or environ.get("VERISPEC_NO_VNNI")),
            amx=environ.get("VERISPEC_KERNEL_AMX", "1") != "0",
            torch_gemm=bool(environ.get("VERISPEC_TORCH_GEMM")),
            panels=environ.get("VERISPEC_PANELS", "1") != "0",
            fused_layers=not environ.get("VERISPEC_LAYER_LOOP"),
            chunked_prefill=bool(environ.get("VERISPEC_CHUNKED_PREFILL")),
            wide_prefill=bool(environ.get("VERISPEC_WIDE_PREFILL")),
            store_copies=environ.get("VERISPEC_STORE_COPIES", "1") not in ("0", "false", "no", ""),
            huge_pages=environ.get("VERISPEC_HUGE_PAGES", "1") not in ("0", "false", "no", ""),
            compiler=environ.get("CC") or None,
        )


_current: KernelConfig | None = None  # read from the environment on first use


def current() -> KernelConfig:
    """The configuration in force: the environment's, read on the first call, unless `configure`d."""
    global _current
    if _current is None:
        _current = KernelConfig.from_env()
    return _current


def configure(config: KernelConfig) -> KernelConfig:
    """Put `config` in force for what runs next (models built afterwards included); returns the previous one."""
    global _current
    previous, _current = current(), config
    return previous
