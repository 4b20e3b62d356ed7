"""The quantized matrices' repacked blocks on huge pages (`kernels.pages`): where they live, and that the numbers
do not depend on it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from verispec.models import kernels
from verispec.models.kernels import config as kernel_config
from verispec.models.kernels import pages

from test_gguf_q8 import random_blocks as kquant_blocks
from test_gguf_q8_legacy import random_blocks as legacy_blocks

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.fixture
def huge_pages(request):
    """The configuration with huge pages on or off (the test's parameter), restored after."""
    previous = kernel_config.configure(dataclasses.replace(kernel_config.current(), huge_pages=request.param))
    yield request.param
    kernel_config.configure(previous)


def anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" not in span or ":" in span:
            continue
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            for field in lines[i + 1 :]:
                if field.startswith("AnonHugePages:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("huge_pages", [True], indirect=True)
def test_small_matrices_share_a_slab_on_cache_lines_and_big_ones_start_on_a_huge_page(huge_pages):
    a, b = pages.empty((3, 100)), pages.empty((7, 50), torch.float32)
    assert a.shape == (3, 100) and b.shape == (7, 50) and b.dtype == torch.float32
    assert a.data_ptr() % pages.ALIGN == 0 and b.data_ptr() % pages.ALIGN == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel()  # cut one after the other, never overlapping
    a.fill_(7)
    b.fill_(-1.0)
    assert int(a.sum()) == 7 * 300 and float(b.sum()) == -350.0
    big = pages.empty((pages.SLAB // 2,))
    assert big.data_ptr() % pages.HUGE_PAGE == 0


@pytest.mark.parametrize("huge_pages", [False], indirect=True)
def test_off_they_are_plain_tensors(huge_pages):
    plain = pages.empty((4, 1000))
    assert plain._base is None and plain.shape == (4, 1000)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages here")
@pytest.mark.parametrize("huge_pages", [True], indirect=True)
def test_a_repacked_matrix_sits_on_huge_pages(huge_pages):
    rng = np.random.default_rng(3)
    # 4 MB of Q4_0 blocks: at least one whole 2 MB page of its own
    matrix = kernels.GGUFMatrix(torch.from_numpy(legacy_blocks("Q4_0", 8192, 896, rng)), 2)
    packed = matrix.values  # repacked now: the first touch of its pages
    assert anon_huge_kb(packed.data_ptr()) >= pages.HUGE_PAGE // 1024


@pytest.mark.parametrize("kind,name", [(12, "Q4_K"), (14, "Q6_K"), (2, "Q4_0")])
def test_products_are_the_same_bits_on_either_pages(kind, name):
    rng = np.random.default_rng(kind)
    raw = torch.from_numpy((legacy_blocks if name == "Q4_0" else kquant_blocks)(name, 40, 512, rng))
    x = torch.from_numpy(rng.standard_normal((5, 512)).astype(np.float32))
    outs = []
    for on in (False, True):
        previous = kernel_config.configure(dataclasses.replace(kernel_config.current(), huge_pages=on))
        try:
            matrix = kernels.GGUFMatrix(raw.clone(), kind)
            outs.append(kernels.Linear(matrix)(x, torch.empty(5, 40)))
            assert (matrix.values._base is not None) == on  # a slab's view, or a tensor of its own
        finally:
            kernel_config.configure(previous)
    assert torch.equal(outs[0], outs[1])
