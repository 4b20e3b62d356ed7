"""The AMX tiles for a q8 target's wide Q4_K and Q6_K passes (csrc/kquant_amx.c) give bitwise what the VNNI tiles
give, and so ggml's formulas: on a CPU with AMX-INT8 every width from AMX_MIN_ROWS runs on them, and each output
must be the same bits as with them turned off (`KernelConfig.amx`), at widths that leave a lone 8-row half tile, a
partial one, or several 16-row tiles, on one thread and on two. The scales are folded into the tiles' bytes (Q4_K's
split in two digits, Q6_K's in three signed ones), so the largest scales and the extreme codes are in every case."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from verispec.models import kernels
from verispec.models.kernels import config as kernel_config
from verispec.models.kernels.runtime import AMX_MIN_ROWS

from test_gguf_q8 import KIND, dot_reference, random_blocks

pytestmark = pytest.mark.skipif(not (kernels.available() and kernels.amx()),
                                reason="no AMX-INT8 tiles here (the VNNI and AVX2 kernels are tested in test_gguf_q8)")


def product(x: torch.Tensor, matrix, bias: torch.Tensor | None, amx: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(kernel_config, "_current", dataclasses.replace(kernel_config.current(), amx=amx))
    assert kernels.amx() == amx
    return kernels.rowwise_linear(x, matrix, bias)


def extreme_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with the folded products' extremes in the first column: Q4_K every 6-bit scale and min 63 (the
    digits 7 and 7); Q6_K a block of codes 0 (q - 32 = -32) under scales among them 124 = 64 * 2 - 8 + 4 (the digit 4:
    4 * -32 = -128, the byte's limit), -128 = 64 * -2 and 127 = 64 * 2 - 1, and one of codes 63, beside random int8
    scales everywhere else."""
    raw = random_blocks(kind, n, k, rng)
    blocks = raw[0].reshape(-1, 144 if kind == "Q4_K" else 210)
    if kind == "Q4_K":
        blocks[:, 4:16] = 255
    else:
        blocks[0, :192] = 0  # codes 0: ql and qh
        blocks[0, 192:208] = np.array([124, -128, 127, -3, 4, -4, 5, 0] * 2, dtype=np.int8).view(np.uint8)
        if len(blocks) > 1:
            blocks[1, :192] = 255  # codes 63
            blocks[1, 192:208] = np.array([124, -128, 127, 60] * 4, dtype=np.int8).view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n, k", [(37, 512), (16, 768), (5, 256)])
@pytest.mark.parametrize("rows", sorted({AMX_MIN_ROWS, AMX_MIN_ROWS + 1, 15, 16, 17, 23, 24, 31, 40, 64} - set(range(AMX_MIN_ROWS))))
def test_wide_products_on_amx_are_the_vnni_kernels_bits(kind, n, k, rows, monkeypatch):
    rng = np.random.default_rng(n * k + rows)
    matrix = kernels.GGUFMatrix(torch.from_numpy(extreme_blocks(kind, n, k, rng)), KIND[kind])
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    x[1, :256] = 0.0  # an all-zero block
    x[2, :256] = torch.where(torch.arange(256) % 2 == 0, -1.0, 1.0)  # codes -127 and 127 against the extremes
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            tiles = product(x, matrix, bias, True, monkeypatch)
            vnni = product(x, matrix, bias, False, monkeypatch)
            assert torch.equal(tiles.view(torch.int32), vnni.view(torch.int32))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_wide_products_on_amx_are_ggml_formulas_bit_for_bit(kind, monkeypatch):
    rng = np.random.default_rng(3)
    n, k = 7, 512
    raw = extreme_blocks(kind, n, k, rng)
    x = rng.standard_normal((AMX_MIN_ROWS + 3, k)).astype(np.float32)
    x[2, 256:] = np.float32(1e-3)  # all |x| tied in a block: the first is the peak
    bias = rng.standard_normal(n).astype(np.float32)
    got = product(torch.from_numpy(x), kernels.GGUFMatrix(torch.from_numpy(raw), KIND[kind]), torch.from_numpy(bias),
                  True, monkeypatch)
    assert np.array_equal(got.numpy().view(np.int32), dot_reference(kind, raw, x, bias).view(np.int32))


def test_turning_the_tiles_off_is_a_switch_of_the_configuration(monkeypatch):
    monkeypatch.setattr(kernel_config, "_current", dataclasses.replace(kernel_config.current(), amx=False))
    assert not kernels.amx()
    monkeypatch.setattr(kernel_config, "_current", dataclasses.replace(kernel_config.current(), amx=True, isa=256))
    assert not kernels.amx()  # the tiles are an AVX-512 path: capping the ISA turns them off with the rest
    assert kernel_config.KernelConfig.from_env({"VERISPEC_KERNEL_AMX": "0"}).amx is False
    assert kernel_config.KernelConfig.from_env({}).amx is True


def test_the_tiles_live_beside_pytorchs_own_use_of_them(monkeypatch):
    """PyTorch's bfloat16 GEMMs run on the same tiles (oneDNN) on the same thread: each user's results stay its own."""
    rng = np.random.default_rng(11)
    raw = random_blocks("Q4_K", 48, 512, rng)
    matrix = kernels.GGUFMatrix(torch.from_numpy(raw), KIND["Q4_K"])
    x = torch.from_numpy(rng.standard_normal((40, 512)).astype(np.float32))
    a, b = torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(512, 384, dtype=torch.bfloat16)
    before = a @ b
    vnni = product(x, matrix, None, False, monkeypatch)
    tiles = product(x, matrix, None, True, monkeypatch)
    between = a @ b
    again = product(x, matrix, None, True, monkeypatch)
    assert torch.equal(before, between) and torch.equal(before, a @ b)
    assert torch.equal(tiles, vnni) and torch.equal(again, vnni)
