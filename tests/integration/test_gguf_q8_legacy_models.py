"""numerics="q8" on the zoo's files of 32-weight blocks: smollm2-135m (Q4_1 matrices, a Q8_0 embedding and head)
and qwen2.5-coder-0.5b (a Q4_K_M file whose rows of 896 llama.cpp stored as Q5_0 / Q8_0, beside Q4_K / Q6_K);
and the products against ggml's own (libggml-cpu of the llama.cpp peer build, skipped where it is not built)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import verispec
from verispec import zoo
from verispec.models import kernels
from verispec.peers import default_bin_dir
from verispec.text import encode_prompt

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable here")

KIND = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}
BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def assert_verify_pass_is_single_steps(model, ids: list[int], tokens: list[int]) -> None:
    """A verify pass over `tokens` after the prompt `ids` gives bitwise the logits of single-token steps."""
    steps = model.new_cache(1)
    model.forward(torch.tensor([ids]), steps, last_only=True)
    single = torch.cat([model.forward(torch.tensor([[t]]), steps) for t in tokens], dim=1)
    cache = model.new_cache(1)
    model.forward(torch.tensor([ids]), cache, last_only=True)
    assert torch.equal(model.forward(torch.tensor([tokens]), cache), single)


def test_smollm2_runs_in_q8_and_speculation_keeps_its_greedy_tokens():
    model = verispec.load("smollm2-135m", numerics="q8")
    assert {layer.up.kind for layer in model.layers} == {3} and model.lm_head.kind == 8  # Q4_1, a tied Q8_0 table
    ids = encode_prompt(model.tokenizer, PROMPT, chat=False)
    plain = verispec.generate(model, ids, drafter="none", max_new_tokens=48)
    for drafter in ("ngram", "self"):
        speculative = verispec.generate(model, ids, drafter=drafter, draft_len=4, max_new_tokens=48)
        assert speculative.token_ids == plain.token_ids, drafter
    assert_verify_pass_is_single_steps(model, ids, plain.token_ids[:8])


@pytest.mark.skipif(not zoo.is_pulled("qwen2.5-coder-0.5b"), reason="qwen2.5-coder-0.5b is not in the zoo cache")
def test_qwen_05b_loads_in_q8_and_decodes():
    model = verispec.load("qwen2.5-coder-0.5b", numerics="q8")
    kinds = {getattr(layer, field).kind for layer in model.layers for field in ("q", "v", "down")}
    assert {6, 8} <= kinds and kinds & {12, 14}  # Q5_0 and Q8_0 beside the k-quants
    ids = encode_prompt(model.tokenizer, PROMPT, chat=False)
    plain = verispec.generate(model, ids, drafter="none", max_new_tokens=24)
    assert "return" in model.tokenizer.decode(plain.token_ids)
    assert verispec.generate(model, ids, drafter="ngram", draft_len=4, max_new_tokens=24).token_ids == plain.token_ids
    assert_verify_pass_is_single_steps(model, ids, plain.token_ids[:8])


def _ggml_cpu():
    path = default_bin_dir() / "libggml-cpu.so"
    if not path.is_file():
        pytest.skip(f"no {path}: build llama.cpp with bench/peers/build_llama_cpp.sh")
    lib = ctypes.CDLL(str(path))
    lib.ggml_cpu_init()

    class Traits(ctypes.Structure):  # ggml-cpu.h's struct ggml_type_traits_cpu
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]

    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    return lib


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_products_are_ggml_own_to_float32_rounding(kind):
    """ggml's quantize_row_q8_0/_q8_1 and vec_dot (this CPU's build) on the same blocks and rows: the integer parts
    and the activations' rounding are the same, only the float sums' order differs (a code rounded otherwise,
    or an integer sum off by one, would move a product by ~1e-3 of its scale)."""
    lib = _ggml_cpu()
    from_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    vec_dot_t = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    traits = lib.ggml_get_type_traits_cpu(KIND[kind]).contents
    from_float = from_float_t(lib.ggml_get_type_traits_cpu(traits.vec_dot_type).contents.from_float)
    vec_dot = vec_dot_t(traits.vec_dot)
    rng = np.random.default_rng(KIND[kind])
    n, k = 33, 576
    raw = rng.integers(0, 256, size=(n * k // 32, BYTES[kind]), dtype=np.uint8)  # random codes (Q8_0's -128 too)
    scales = 2 if kind in ("Q4_1", "Q5_1") else 1  # d (and m) finite half floats
    raw[:, :2 * scales] = (rng.standard_normal((len(raw), scales)) * 0.02).astype(np.float16).view(np.uint8).reshape(len(raw), -1)
    raw = raw.reshape(n, -1)
    x = rng.standard_normal((4, k)).astype(np.float32)
    theirs = np.empty((4, n), np.float32)
    rounded, out = np.zeros(k // 32 * 36, np.uint8), np.zeros(1, np.float32)
    for r in range(4):
        row = np.ascontiguousarray(x[r])
        from_float(row.ctypes.data, rounded.ctypes.data, k)
        for c in range(n):
            vec_dot(k, out.ctypes.data, 0, np.ascontiguousarray(raw[c]).ctypes.data, 0, rounded.ctypes.data, 0, 1)
            theirs[r, c] = out[0]
    ours = kernels.rowwise_linear(torch.from_numpy(x), kernels.GGUFMatrix(torch.from_numpy(raw), KIND[kind])).numpy()
    assert np.abs(ours - theirs).max() < 1e-6 * np.abs(theirs).max()
