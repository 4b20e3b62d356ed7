"""The native Llama/Qwen2 forward against transformers, and the exactness its kernels promise.

Tiny random-weight models (see conftest). Two claims are checked:
- close: native logits match the HF model's to float32 rounding, and greedy decoding (plain or
  speculative, alone or batched) gives the HF tokens;
- exact: in small passes a row's logits are bitwise independent of the pass width, its batch mates
  and rollback holes, so a width-k verify pass sees what k single-token steps would.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import verispec
from conftest import on_path, perturbed_copy, prefilled, tiny_gpt2, tiny_llama, tiny_qwen2
from verispec.prefill import left_pad
from verispec.models import kernels
from verispec.models.kernels import config as kernel_config
from verispec.models import native as native_module
from verispec.models.native import NativeCausalLM, NativeStore, supports

PROMPTS = [[1, 5, 6, 7, 8, 9, 5, 6, 7], [1, 20, 21], [4], [1, 30, 31, 32, 30, 31, 32, 30, 31, 40, 41, 42]]
SEQUENCE = [1, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler or no AVX2/AVX-512 CPU")


def use_kernels(monkeypatch, **changes):
    """The rest of the test runs with these `KernelConfig` fields changed (restored afterwards)."""
    monkeypatch.setattr(kernel_config, "_current", dataclasses.replace(kernel_config.current(), **changes))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(HF model, native model over the same weights)."""
    hf = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param](seed=0)
    return hf, NativeCausalLM.from_hf(hf)


@pytest.fixture(params=["kernels", "torch"])
def native(request, pair, monkeypatch):
    """The native model with its exact kernels, and with the plain torch path it falls back to."""
    return on_path(pair[1], request.param, monkeypatch)


def run(model, chunks, batch_size=1):
    """Feed token chunks [B, T] one forward pass each; return the logits of every pass, concatenated on T."""
    cache = model.new_cache(batch_size)
    return torch.cat([model.forward(chunk, cache) for chunk in chunks], 1), cache


# --- close to transformers ----------------------------------------------------------------------

def test_supports_llama_qwen2_only(pair):
    hf, _ = pair
    assert supports(hf) and supports(hf.model)
    assert not supports(tiny_gpt2())
    with pytest.raises(ValueError, match="not supported"):
        NativeCausalLM.from_hf(tiny_gpt2())


def test_same_contract_attributes(pair):
    hf, model = pair
    for attribute in ("vocab_size", "max_context", "eos_token_ids", "device", "config"):
        assert getattr(model, attribute) == getattr(hf, attribute), attribute
    assert model.name == hf.name
    head = hf.model.get_output_embeddings().weight
    if isinstance(model.lm_head, kernels.PanelMatrix):  # AVX2: a copy in 16-row panels, the same numbers
        assert torch.equal(model.lm_head.dequantize(), head)
        assert model.embed.data_ptr() == hf.model.get_input_embeddings().weight.data_ptr()
    else:
        assert model.lm_head.data_ptr() == head.data_ptr()  # borrowed, not copied


def test_loaded_native_belongs_to_its_own_model():
    """`load` builds a native forward once per transformers model and never hands one model's to another,
    even when a freed model's id is reused; the cache does not keep a caller's model alive."""
    import gc
    import weakref

    first = tiny_llama(seed=0).model
    native = verispec.load(first)
    assert isinstance(native, NativeCausalLM) and verispec.load(first) is native and native.hf_model is first
    gone = weakref.ref(first)
    del first, native
    gc.collect()
    assert gone() is None
    for seed in range(1, 6):  # fresh models often land at the freed address
        model = tiny_llama(seed=seed).model
        assert verispec.load(model).hf_model is model


def test_logits_match_hf_prefill_then_decode(pair, native):
    hf, _ = pair
    tokens = torch.tensor([SEQUENCE])
    chunks = [tokens[:, :12]] + [tokens[:, t : t + 1] for t in range(12, 16)] + [tokens[:, 16:]]
    expected, _ = run(hf, chunks)
    got, _ = run(native, chunks)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("width", [9, 45])
def test_last_only_scores_the_last_position(pair, native, width):
    """last_only logits are the full pass's last row, and the cache it leaves (a wide pass skips the
    last layer's other rows past their keys and values) continues exactly like the full pass's."""
    tokens, visible = left_pad([(SEQUENCE * 3)[:width], (SEQUENCE * 3)[3:width]])
    full_cache, last_cache = native.new_cache(2), native.new_cache(2)
    full = native.forward(tokens, full_cache, visible)
    last = native.forward(tokens, last_cache, visible, last_only=True)
    assert last.shape == (2, 1, native.vocab_size)
    torch.testing.assert_close(last[:, 0], full[:, -1], atol=1e-5, rtol=1e-5)
    step = torch.tensor([[7], [8]])
    assert torch.equal(native.forward(step, last_cache), native.forward(step, full_cache))


def test_cache_grows_past_its_first_capacity(pair, native):
    hf, _ = pair
    tokens = torch.arange(150).remainder(90).add(4)[None]  # 150 slots > the 64 first allocated
    chunks = [tokens[:, :40]] + [tokens[:, t : t + 5] for t in range(40, 150, 5)]
    expected, _ = run(hf, chunks)
    got, cache = run(native, chunks)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.store.capacity >= 150 and cache.store.length == 150


def test_left_padding_matches_each_row_alone(pair, native):
    rows = [SEQUENCE[:9], SEQUENCE[:3], SEQUENCE[5:6]]
    tokens, visible = left_pad(rows)
    cache = native.new_cache(len(rows))
    logits = native.forward(tokens, cache, visible)
    assert torch.isfinite(logits).all()  # padding queries see nothing, yet produce no NaN
    step = native.forward(torch.tensor([[30], [31], [32]]), cache)
    for b, row in enumerate(rows):
        alone_cache = native.new_cache(1)
        alone = native.forward(torch.tensor([row]), alone_cache)
        torch.testing.assert_close(logits[b, -len(row) :], alone[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[b], native.forward(torch.tensor([[30 + b]]), alone_cache)[0], atol=1e-5, rtol=1e-5)


def test_long_prompt_prefill_matches_hf(pair, native):
    """A prompt wider than a small pass (a big pass: on AVX2 CPUs through `kernels.blocked_linear`)
    gives HF's logits, and greedy decoding after it HF's tokens."""
    hf, _ = pair
    prompt = torch.arange(75).mul(7).remainder(90).add(4)[None]
    expected, _ = run(hf, [prompt])
    got, _ = run(native, [prompt])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    tokens = prompt[0].tolist()
    assert (verispec.generate(native, tokens, drafter="none", max_new_tokens=12).token_ids
            == verispec.generate(hf, tokens, drafter="none", max_new_tokens=12).token_ids)


# --- greedy tokens through the engine -------------------------------------------------------------

def test_plain_greedy_equals_hf(pair, native):
    hf, _ = pair
    for prompt in PROMPTS:
        expected = verispec.generate(hf, prompt, drafter="none", max_new_tokens=30).token_ids
        assert verispec.generate(native, prompt, drafter="none", max_new_tokens=30).token_ids == expected


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("draft_len", [1, 3, 5])
def test_speculative_equals_plain(pair, native, drafter, draft_len):
    hf, _ = pair
    draft = NativeCausalLM.from_hf(perturbed_copy(hf, scale=0.05))
    for prompt in PROMPTS:
        expected = verispec.generate(native, prompt, drafter="none", max_new_tokens=30).token_ids
        got = verispec.generate(native, prompt, draft=draft, drafter=drafter, draft_len=draft_len, max_new_tokens=30)
        assert got.token_ids == expected, f"prompt {prompt}"


@pytest.mark.parametrize("drafter", ["model", "ngram", "none"])
def test_batch_equals_each_alone(pair, native, drafter):
    hf, _ = pair
    draft = NativeCausalLM.from_hf(perturbed_copy(hf, scale=0.05))
    batch = verispec.generate(native, PROMPTS, draft=draft, drafter=drafter, draft_len=4, max_new_tokens=30)
    alone = [verispec.generate(native, p, drafter="none", max_new_tokens=30).token_ids for p in PROMPTS]
    assert [r.token_ids for r in batch] == alone


def test_speculation_accepts_with_native_target(pair):
    """Guard against a vacuous pass: the perturbed draft must get tokens accepted."""
    hf, model = pair
    draft = NativeCausalLM.from_hf(perturbed_copy(hf, scale=0.05))
    saved, model.eos_token_ids = model.eos_token_ids, frozenset()
    try:
        result = verispec.generate(model, PROMPTS[0], draft=draft, draft_len=4, max_new_tokens=40)
    finally:
        model.eos_token_ids = saved
    assert result.stats.mean_accepted_tokens > 1.5


def test_bf16_draft_is_close_and_output_stays_the_targets(pair, native):
    """bfloat16 matrices make a cheaper draft: logits move a little, the target's tokens not at all."""
    hf, _ = pair
    draft = NativeCausalLM.from_hf(hf, weight_dtype=torch.bfloat16)
    assert draft.lm_head.dtype == torch.bfloat16 and native.lm_head.dtype == torch.float32
    tokens = torch.arange(40).remainder(90).add(4)[None]  # 40 > MAX_ROWS: the prefill takes the PyTorch path
    chunks = [tokens[:, :36], tokens[:, 36:38], tokens[:, 38:]]
    exact, _ = run(native, chunks)
    approx, _ = run(draft, chunks)
    assert (approx - exact).abs().max() < 0.05 * exact.abs().max()
    assert not torch.equal(approx, exact)
    for prompt in PROMPTS:
        expected = verispec.generate(native, prompt, drafter="none", max_new_tokens=30).token_ids
        assert verispec.generate(native, prompt, draft=draft, draft_len=4, max_new_tokens=30).token_ids == expected


def test_int8_matrix_rounds_each_row_to_its_own_scale():
    torch.manual_seed(0)
    dense = torch.randn(50, 70) * torch.logspace(-3, 1, 50)[:, None]  # rows of very different magnitude
    matrix = kernels.Int8Matrix.quantize(dense)
    assert matrix.values.dtype == torch.int8 and matrix.shape == dense.shape
    assert int(matrix.values.abs().max()) == 127
    error = (matrix.dequantize() - dense).abs().amax(1)
    assert (error <= matrix.scale / 2 + 1e-7).all()  # round to nearest: at most half a step per row
    assert torch.equal(matrix[torch.tensor([3, 7])].values, matrix.values[[3, 7]])


def test_int4_matrix_rounds_each_group_to_its_own_scale():
    torch.manual_seed(0)
    dense = torch.randn(6, 192) * torch.logspace(-3, 1, 3).repeat_interleave(64)  # groups of very different magnitude
    matrix = kernels.Int4Matrix.quantize(dense)
    assert matrix.values.dtype == torch.uint8 and matrix.values.shape == (6, 96) and matrix.shape == dense.shape
    assert matrix.scale.shape == (6, 3)
    groups, scale = dense.reshape(6, 3, 64), matrix.scale[..., None]
    error = (matrix.dequantize().reshape(6, 3, 64) - groups).abs()
    inside = groups.abs() <= 7 * scale  # not clipped: rounded to the nearest step of its group's scale
    assert (error[inside] <= (scale / 2 + 1e-7).expand_as(groups)[inside]).all()
    # the clipping search never does worse than scaling each group to its largest weight
    peak = groups.abs().amax(2, keepdim=True) / 7
    plain = (torch.round(groups / peak).clamp(-8, 7) * peak - groups).pow(2).sum(2)
    assert (error.pow(2).sum(2) <= plain * (1 + 1e-5)).all()
    assert torch.equal(matrix[torch.tensor([4, 1])].dequantize(), matrix.dequantize()[[4, 1]])
    with pytest.raises(ValueError, match="divisible by 64"):
        kernels.Int4Matrix.quantize(torch.randn(4, 70))



def test_int4_quantize_in_c_matches_the_pytorch_reference():
    """The C quantizer (a group in registers) makes the codes and scales of the PyTorch reference."""
    if not kernels.available():
        pytest.skip("C kernels unavailable here")
    torch.manual_seed(1)
    dense = torch.randn(96, 640) * torch.logspace(-4, 1, 96)[:, None]
    dense[::7, ::13] *= 20  # lone outliers, where clipping wins
    dense[5, 64:128] = 0.0  # an all-zero group: its scale comes from the 1e-12 floor
    dense[6, :64] = -dense[6, :64].abs()  # a group whose peak is a negative weight
    fast, reference = kernels.Int4Matrix.quantize(dense), kernels.Int4Matrix.quantize_reference(dense)
    assert torch.equal(fast.scale, reference.scale) and torch.equal(fast.values, reference.values)
    assert not torch.equal(fast.scale, dense.reshape(96, 10, 64).abs().amax(2) / 7)  # some groups were clipped
    # Both vector widths (8 lanes on AVX2, 16 on AVX-512) give the same codes and scales.
    for isa in [256] + ([512] if kernels.isa() == 512 else []):
        values, scale = torch.empty_like(fast.values), torch.empty_like(fast.scale)
        shrinks = kernels.Int4Matrix.SHRINKS.contiguous()
        kernels.runtime().lib.int4_quantize(dense.data_ptr(), values.data_ptr(), scale.data_ptr(), shrinks.data_ptr(), 96, 640,
                                       len(shrinks), isa, 2)
        assert torch.equal(scale, reference.scale) and torch.equal(values, reference.values), isa


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.quint4x2])
def test_quantized_draft_prefill_uses_a_kept_widened_copy(pair, weight_dtype, monkeypatch):
    """A big pass (prefill) multiplies a widened copy of an int8/int4 matrix (bfloat16 where the CPU
    multiplies it fastest, else float32), made once and kept; it computes the small passes' function up
    to rounding."""
    hf, _ = pair
    draft = NativeCausalLM.from_hf(hf, weight_dtype=weight_dtype)
    if not draft._kernels:
        pytest.skip("exact kernels unavailable here")
    use_kernels(monkeypatch, wide_prefill=True)  # not the int4 chunks of an AVX2 CPU
    monkeypatch.setattr(kernels, "blocked_preferred", lambda: False)  # PyTorch's GEMM, which takes the copy
    tokens = torch.arange(40).remainder(90).add(4)[None]
    big, _ = run(draft, [tokens])  # 40 > MAX_ROWS: the PyTorch path
    small, _ = run(draft, [tokens[:, :20], tokens[:, 20:]])  # the kernels
    assert (big - small).abs().max() < 0.1 * small.abs().max()  # int8 activations vs float ones
    (dtype, copy), = draft.layers[0].gate._widened.items()  # the one copy (made at load, or by the big pass)
    assert dtype == (torch.bfloat16 if native_module._fast_bfloat16_matmul() else torch.float32)
    big_again, _ = run(draft, [tokens])
    assert torch.equal(big, big_again) and draft.layers[0].gate.widened(dtype) is copy


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.quint4x2])
def test_widened_prefill_copies_are_made_at_load(pair, weight_dtype, monkeypatch):
    """Where a prefill multiplies widened copies (PyTorch's GEMM), they exist before the first request, so
    its draft prefill is not priced with their one-time cost; the LM head is not widened (prefills score
    one row); with chunked prefills nothing is widened."""
    hf, _ = pair
    monkeypatch.setattr(kernels, "blocked_preferred", lambda: False)
    draft = NativeCausalLM.from_hf(hf, weight_dtype=weight_dtype)
    if not draft._kernels:
        pytest.skip("exact kernels unavailable here")
    chunks = draft._prefills_in_chunks(1, kernels.MAX_ROWS + 1)
    assert all(bool(getattr(layer, field)._widened) != chunks for layer in draft.layers for field in ("q", "gate", "down"))
    assert not draft.lm_head._widened
    if weight_dtype == torch.quint4x2 and kernels._int4_code() in (4, 5):
        use_kernels(monkeypatch, chunked_prefill=True)
        chunked = NativeCausalLM.from_hf(hf, weight_dtype=weight_dtype)
        assert not chunked.layers[0].gate._widened


@pytest.mark.parametrize("batch", [1, 3])
def test_int4_draft_prefills_in_small_passes(pair, batch, monkeypatch):
    """With int8-rounded activations a 4-bit draft prefills through its decode kernels, MAX_ROWS rows at a
    time: bitwise what one-token passes give (padding included), and no widened float copy is made."""
    hf, _ = pair
    # int8 activations; chunked prefills, opt-in where PyTorch's GEMM prefills
    use_kernels(monkeypatch, int8_activations=True, chunked_prefill=True)
    draft = NativeCausalLM.from_hf(hf, weight_dtype=torch.quint4x2)
    if not draft._kernels:
        pytest.skip("exact kernels unavailable here")
    assert draft._prefills_in_chunks(batch, 70)
    lengths = [70, 45, 12][:batch]
    prompts = [[4 + (7 * b + 3 * i) % 90 for i in range(n)] for b, n in enumerate(lengths)]
    tokens, visible = left_pad(prompts)
    cache = draft.new_cache(batch)
    last = draft.forward(tokens, cache, visible, last_only=True)[:, -1]
    step = draft.forward(torch.tensor([[5]] * batch), cache)[:, -1]
    assert not draft.layers[0].gate._widened  # never widened
    for b, prompt in enumerate(prompts):
        alone = draft.new_cache(1)
        for token in prompt:
            one = draft.forward(torch.tensor([[token]]), alone)[:, -1]
        assert torch.equal(one[0], last[b])
        assert torch.equal(draft.forward(torch.tensor([[5]]), alone)[0, -1], step[b])


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.int8, torch.quint4x2, "q4_0", "q3_0"])
@pytest.mark.parametrize("vocab", [None, 48, "48+read"])
def test_cheap_native_drafts_keep_the_targets_output(pair, native, weight_dtype, vocab):
    """int8 / bf16 / int4 matrices, ggml's Q4_0 blocks (with 3-bit gate and up blocks for "q3_0") and a
    restricted head make cheaper drafts: the target's greedy tokens do not move, and a restricted draft scores
    (so proposes) only its own tokens."""
    from verispec.models.draft_variants import restrict_vocabulary
    from verispec.models.kernels.matrices import Q3_0

    hf, _ = pair
    if weight_dtype in ("q4_0", "q3_0") and not kernels.available():
        pytest.skip("Q4_0 and Q3_0 blocks run on verispec's q8 kernels, unavailable here")
    draft = NativeCausalLM.from_hf(hf, weight_dtype=weight_dtype)
    if weight_dtype in ("q4_0", "q3_0"):  # llama.cpp's numerics on blocks rounded from the float weights
        assert draft.numerics == "q8" and draft._kernels and draft.name.endswith(f"-{weight_dtype}")
        assert all(getattr(layer, f).kind == 2 for layer in draft.layers for f in ("q", "down")) and draft.lm_head.kind == 2
        three = Q3_0 if weight_dtype == "q3_0" else 2
        assert all(getattr(layer, f).kind == three for layer in draft.layers for f in ("gate", "up"))
    if vocab:
        draft = restrict_vocabulary(draft, 48, reads=vocab == "48+read")
        cache = draft.new_cache(1)
        logits = draft.forward(torch.tensor([[1, 5, 6, 7]]), cache)
        outside = torch.ones(draft.vocab_size, dtype=torch.bool)
        outside[draft.output_ids] = False
        assert logits.shape[-1] == native.vocab_size and torch.isinf(logits[..., outside]).all()
        assert torch.isfinite(logits[..., ~outside]).all()
    proposed = 0
    for prompt in PROMPTS:
        expected = verispec.generate(native, prompt, drafter="none", max_new_tokens=24).token_ids
        result = verispec.generate(native, prompt, draft=draft, draft_len=4, max_new_tokens=24)
        assert result.token_ids == expected
        proposed += result.stats.accepted_tokens
    assert proposed > 0  # the cheap draft still gets tokens accepted: the comparison is not vacuous


@pytest.mark.parametrize("weight_dtype", [None, "q4_0"])
def test_a_reading_head_scores_the_tokens_its_text_held(pair, weight_dtype):
    """A restricted head that reads (`with_output_ids(..., reads=True)`) scores, beside its own ids, every token
    its cache's text has held, with the full head's logits for them (to float rounding: float32 rows against
    the kernels' products); tokens neither set holds stay at -inf; a batch joined from two caches scores both
    texts' tokens."""
    if weight_dtype == "q4_0" and not kernels.available():
        pytest.skip("Q4_0 blocks run on verispec's q8 kernels, unavailable here")
    hf, _ = pair
    full = NativeCausalLM.from_hf(hf, weight_dtype=weight_dtype)
    draft = full.with_output_ids(torch.arange(40), reads=True)
    assert draft.name.endswith("-vocab40+read") and draft.lm_head.shape[0] == 40
    text, other = [1, 5, 70, 90, 70], [2, 80, 3]
    cache, reference = draft.new_cache(1), full.new_cache(1)
    logits = draft.forward(torch.tensor([text]), cache)[0, -1]
    expected = full.forward(torch.tensor([text]), reference)[0, -1]
    held = torch.tensor([70, 90])
    assert torch.allclose(logits[held], expected[held], rtol=1e-3, atol=1e-3 if weight_dtype is None else 5e-2)
    plain = full.with_output_ids(torch.arange(40))  # the head's own ids: the same numbers as without reading
    assert torch.equal(logits[:40], plain.forward(torch.tensor([text]), plain.new_cache(1))[0, -1, :40])
    never = torch.ones(draft.vocab_size, dtype=torch.bool)
    never[:40] = False
    never[held] = False
    assert torch.isinf(logits[never]).all() and torch.isfinite(logits[~never]).all()
    second = draft.new_cache(1)
    draft.forward(torch.tensor([other]), second)
    cache.concat(second)
    both = draft.forward(torch.tensor([[5], [6]]), cache)[:, -1]
    assert torch.isfinite(both[:, [70, 80, 90]]).all() and torch.isinf(both[:, 85]).all()
    cache.select(torch.tensor([1]))  # the first text leaves the batch, and its words with it
    left = draft.forward(torch.tensor([[7]]), cache)[0, -1]
    assert torch.isfinite(left[80]) and torch.isinf(left[[70, 90]]).all()
    assert torch.allclose(left[80], full.forward(torch.tensor([other + [6, 7]]), full.new_cache(1))[0, -1, 80],
                          rtol=1e-3, atol=1e-3 if weight_dtype is None else 5e-2)


def test_restricted_head_cannot_be_restricted_again(pair):
    from verispec.errors import VerispecError
    from verispec.models.draft_variants import restrict_vocabulary

    hf, model = pair
    draft = restrict_vocabulary(model, 40)
    assert draft.lm_head.shape[0] < model.lm_head.shape[0] and model.output_ids is None  # the original is untouched
    with pytest.raises(VerispecError, match="already"):
        restrict_vocabulary(draft, 20)


# --- rollback, select, concat ---------------------------------------------------------------------

def test_rollback_then_reforward_equals_fresh_cache(pair, native):
    exact = native._kernels
    tokens = torch.tensor([SEQUENCE])
    cache = native.new_cache(1)
    native.forward(tokens[:, :10], cache)
    native.forward(torch.tensor([[50, 51, 52, 53, 54]]), cache)  # a draft that gets rejected
    cache.truncate(torch.tensor([10]))
    assert cache.store.length == 10
    again = native.forward(tokens[:, 10:15], cache)
    fresh_cache = native.new_cache(1)
    native.forward(tokens[:, :10], fresh_cache)
    fresh = native.forward(tokens[:, 10:15], fresh_cache)
    if exact:
        assert torch.equal(again, fresh)
    torch.testing.assert_close(again, fresh, atol=1e-5, rtol=1e-5)


def test_holes_from_rollback_do_not_shift_a_row(pair, native):
    """Row 0 accepts 1 of 4 draft tokens, row 1 all 4: row 0's holes stay masked for ever."""
    cache = native.new_cache(2)
    native.forward(torch.tensor([SEQUENCE[:6], SEQUENCE[6:12]]), cache)
    native.forward(torch.tensor([[60, 61, 62, 63], [64, 65, 66, 67]]), cache)
    cache.truncate(torch.tensor([7, 10]))
    step = native.forward(torch.tensor([[70], [71]]), cache)
    alone0 = native.new_cache(1)
    native.forward(torch.tensor([SEQUENCE[:6] + [60]]), alone0)
    alone1 = native.new_cache(1)
    native.forward(torch.tensor([SEQUENCE[6:12] + [64, 65, 66, 67]]), alone1)
    torch.testing.assert_close(step[0], native.forward(torch.tensor([[70]]), alone0)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1], native.forward(torch.tensor([[71]]), alone1)[0], atol=1e-5, rtol=1e-5)
    if native._kernels:  # holes are skipped, not masked: bitwise what the row gives alone
        assert torch.equal(step[0], native.forward(torch.tensor([[70]]), prefilled(native, SEQUENCE[:6] + [60]))[0])


def test_select_and_concat_rows(pair, native):
    rows = [SEQUENCE[:4], SEQUENCE[4:11], SEQUENCE[11:14]]
    caches = [prefilled(native, r) for r in rows]
    expected = [native.forward(torch.tensor([[40 + i]]), prefilled(native, r))[0] for i, r in enumerate(rows)]

    cache = caches[0]
    cache.concat(caches[1])  # shorter rows are padded on the slot axis with invisible slots
    cache.concat(caches[2])
    assert cache.batch_size == 3 and cache.store.batch_size == 3
    cache.select([2, 0])
    got = native.forward(torch.tensor([[42], [40]]), cache)
    torch.testing.assert_close(got[0], expected[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[0], atol=1e-5, rtol=1e-5)


def test_store_trim_moves_length_only():
    store = NativeStore(2, 1, 2, 16, torch.float32, torch.device("cpu"))
    store.reserve(10)
    store.length = 10
    keys = store.keys
    store.trim(4)
    assert store.length == 4 and store.keys is keys
    store.reserve(64)
    assert store.keys is keys  # capacity 64 already: no reallocation
    store.reserve(65)
    assert store.capacity == 128


# --- the exactness premise ------------------------------------------------------------------------

@needs_kernels
def test_width_k_pass_equals_k_single_steps(pair):
    """Verification scores k+1 tokens in one pass; plain decoding scores them one by one."""
    _, model = pair
    tokens = torch.tensor([SEQUENCE])
    for width in (2, 5, 8):
        cache = prefilled(model, SEQUENCE[:8])
        wide = model.forward(tokens[:, 8 : 8 + width], cache)
        cache = prefilled(model, SEQUENCE[:8])
        singles = torch.cat([model.forward(tokens[:, t : t + 1], cache) for t in range(8, 8 + width)], 1)
        assert torch.equal(wide.argmax(-1), singles.argmax(-1))
        assert torch.equal(wide, singles), f"width {width}: max diff {(wide - singles).abs().max()}"


@needs_kernels
@pytest.mark.parametrize("fmt", ["f32", "panels", "bf16", "int8", "int4", "int4-vnni", "int4-avx2"])
def test_fused_layers_equal_the_layer_loop(pair, fmt, monkeypatch):
    """A small pass runs every layer in one C call (`kernels.LayerStack`): bitwise the logits of the Python
    loop over the same kernels, for decode and verify widths, padded batches, rollback holes and token
    trees, on every matrix format."""
    if fmt == "int4-vnni" and not kernels.vnni():
        pytest.skip("CPU lacks AVX-512 VNNI")
    if fmt == "int4-avx2":
        use_kernels(monkeypatch, isa=256, vnni=False)  # the AVX2 int8-activation path, on any AVX2 CPU
    use_kernels(monkeypatch, int8_activations=fmt in ("int4-vnni", "int4-avx2"))
    assert kernels._int4_code() == {"int4-vnni": 4, "int4-avx2": 5}.get(fmt, 3)
    hf, _ = pair
    weight_dtype = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.quint4x2, "int4-vnni": torch.quint4x2,
                    "int4-avx2": torch.quint4x2}.get(fmt)
    model = NativeCausalLM.from_hf(hf, weight_dtype=weight_dtype, panels=fmt == "panels")
    assert model._layer_stack() is not None  # the fused path is really taken below
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]] * 2, dtype=torch.bool)

    def passes(fused: bool) -> list[torch.Tensor]:
        model.fused_layers = fused
        tokens, visible = left_pad([SEQUENCE[:7], SEQUENCE[3:6]])
        cache = model.new_cache(2)
        out = [model.forward(tokens, cache, visible)]
        out.append(model.forward(torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]), cache))
        cache.truncate(torch.tensor([cache.slots.length - 3, cache.slots.length - 1]))  # holes differ per row
        out.append(model.forward(torch.tensor([[30], [31]]), cache))
        out.append(model.forward(torch.tensor([[40, 41, 42, 43], [50, 51, 52, 53]]), cache, tree=tree))
        return out

    for fused, loop in zip(passes(True), passes(False)):
        assert torch.equal(fused, loop)


@pytest.mark.parametrize("fmt", ["f32-fused", "f32-loop", "int4", "torch"])
def test_a_prompts_read_stores_the_keys_and_values_a_forward_pass_stores(pair, fmt, monkeypatch):
    """`extend` stops the last layer once its keys and values are stored and runs no LM head: the cache it leaves
    is bitwise a forward pass's, and so are the logits of the steps after it, on the fused C layers, the layer
    loop, an int4 model and the PyTorch path."""
    hf, _ = pair
    model = NativeCausalLM.from_hf(hf, weight_dtype=torch.quint4x2 if fmt == "int4" else None)
    model = on_path(model, "torch" if fmt == "torch" else "kernels", monkeypatch)
    model.fused_layers = fmt != "f32-loop"
    prompts = torch.tensor([SEQUENCE[:15], SEQUENCE[5:]])
    read, passed = model.new_cache(2), model.new_cache(2)
    model.extend(prompts, read)
    model.forward(prompts, passed, last_only=True)
    assert torch.equal(read.store.keys, passed.store.keys) and torch.equal(read.store.values, passed.store.values)
    for step in (torch.tensor([[11, 12, 13], [21, 22, 23]]), torch.tensor([[30], [31]])):
        assert torch.equal(model.forward(step, read), model.forward(step, passed))


@needs_kernels
def test_batch_mates_do_not_change_a_row(pair):
    _, model = pair
    alone = model.forward(torch.tensor([[9, 8, 7]]), prefilled(model, SEQUENCE[:5]))
    cache = model.new_cache(3)
    model.forward(torch.tensor([SEQUENCE[:5], SEQUENCE[5:10], SEQUENCE[10:15]]), cache)
    together = model.forward(torch.tensor([[9, 8, 7], [1, 2, 3], [4, 5, 6]]), cache)
    assert torch.equal(together[0], alone[0])


def _int8_rounded_by_group(x: torch.Tensor, group: int = 64) -> torch.Tensor:
    """x as the VNNI int4 path sees it: each row rounded to int8 per group, scale max|x| / 127."""
    groups = x.reshape(x.shape[0], -1, group)
    peak = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    return (torch.round(groups * inverse) * (peak / 127.0)).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("isa", [512, 256])
@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "int4-vnni", "int4-avx2", "panels"])
def test_rowwise_linear_rows_are_independent(isa, fmt, monkeypatch):
    """Each row of a product is bitwise what it is alone, and the product is the dense one (int4
    matrices on an int8-activation path see the activations rounded per group of 64)."""
    if isa > kernels.isa():
        pytest.skip(f"CPU lacks the {isa}-bit kernel")
    if fmt == "int4-vnni" and not (isa == 512 and kernels.vnni()):
        pytest.skip("the VNNI int8-activation int4 path needs AVX-512 VNNI")
    if fmt == "panels" and isa == 512:
        pytest.skip("panel matrices have one kernel, AVX2+FMA")
    use_kernels(monkeypatch, isa=isa, vnni=fmt == "int4-vnni", int8_activations=fmt in ("int4-vnni", "int4-avx2"))
    assert kernels._int4_code() == {"int4-vnni": 4, "int4-avx2": 5}.get(fmt, 3)
    torch.manual_seed(0)
    int4 = fmt.startswith("int4")
    # tails in k and n, k > KBLOCK; int4 needs k in whole groups of 64
    shapes = ((97, 64), (64, 128), (8, 192), (20, 1152)) if int4 else ((97, 70), (64, 128), (8, 33), (20, 1100))
    for out_features, in_features in shapes:
        dense, bias = torch.randn(out_features, in_features), torch.randn(out_features)
        if fmt in ("f32", "bf16"):
            weight = dense.to(torch.float32 if fmt == "f32" else torch.bfloat16)
            reference = weight.float()
        elif fmt == "panels":
            weight, reference = kernels.PanelMatrix.pack(dense), dense
        else:
            weight = (kernels.Int4Matrix if int4 else kernels.Int8Matrix).quantize(dense)
            reference = weight.dequantize()
        x = torch.randn(13, in_features)
        full = kernels.rowwise_linear(x, weight, bias)
        seen = _int8_rounded_by_group(x) if fmt in ("int4-vnni", "int4-avx2") else x
        torch.testing.assert_close(full, torch.nn.functional.linear(seen, reference, bias), atol=1e-4, rtol=1e-4)
        for lo in range(13):
            for hi in range(lo + 1, 14):
                assert torch.equal(kernels.rowwise_linear(x[lo:hi], weight, bias), full[lo:hi])


@needs_kernels
@pytest.mark.parametrize("isa", [512, 256])
@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "int4-vnni", "int4-avx2", "panels"])
def test_linear_group_equals_its_linears_called_alone(isa, fmt, monkeypatch):
    """q/k/v and gate/up run as one grouped call: every output bitwise what its own call gives, edges
    (widths not a multiple of the tile) and every row count of a verify pass included."""
    if isa > kernels.isa():
        pytest.skip(f"CPU lacks the {isa}-bit kernel")
    if fmt == "int4-vnni" and not (isa == 512 and kernels.vnni()):
        pytest.skip("CPU lacks AVX-512 VNNI")
    use_kernels(monkeypatch, isa=isa, vnni=fmt == "int4-vnni", int8_activations=fmt in ("int4-vnni", "int4-avx2"))
    assert kernels._int4_code() == {"int4-vnni": 4, "int4-avx2": 5}.get(fmt, 3)
    torch.manual_seed(0)
    in_features = 192
    linears = []
    for out_features in (64, 18, 7):
        dense = torch.randn(out_features, in_features)
        weight = {"f32": dense, "bf16": dense.to(torch.bfloat16), "int8": kernels.Int8Matrix.quantize(dense),
                  "panels": kernels.PanelMatrix.pack(dense)}.get(
            fmt, kernels.Int4Matrix.quantize(dense) if fmt.startswith("int4") else None)
        linears.append(kernels.Linear(weight, torch.randn(out_features)))
    group = kernels.LinearGroup(linears)
    for rows in range(1, 10):
        x = torch.randn(rows, in_features)
        outs = [torch.full((rows, lin.n), float("nan")) for lin in linears]
        group(x, outs)
        for lin, out in zip(linears, outs):
            assert torch.equal(out, lin(x, torch.empty(rows, lin.n)))
    with pytest.raises(ValueError, match="input width"):
        kernels.LinearGroup([linears[0], kernels.Linear(torch.randn(4, 64))])


@pytest.mark.skipif(not (kernels.available() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")),
                    reason="blocked_linear needs AVX2+FMA")
def test_blocked_linear_is_the_dense_product_and_rows_are_independent():
    """The prefill GEMM: close to a float64 product over tails in every dimension (rows not a multiple
    of its 6-row tile, columns of its 16, k of its 8-wide packing and 256-long blocks), biases or none,
    several matrices sharing x; and each row bitwise what it is alone or with any other rows."""
    torch.manual_seed(0)
    for in_features in (1, 9, 256, 300, 600):
        weights = [torch.randn(n, in_features) for n in (1, 17, 40)]
        biases = [torch.randn(1), None, torch.randn(40)]
        x = torch.randn(37, in_features)
        full = kernels.blocked_linear(x, weights[1:], biases[1:])
        alone = kernels.blocked_linear(x, weights, biases)
        for out, weight, bias in zip(alone, weights, biases):
            reference = x.double() @ weight.double().T + (0 if bias is None else bias.double())
            torch.testing.assert_close(out.double(), reference, atol=1e-4 * in_features ** 0.5, rtol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(alone[1:], full))  # group mates change nothing
        for lo, hi in ((0, 1), (5, 6), (3, 10), (6, 12), (30, 37), (1, 36)):
            part = kernels.blocked_linear(x[lo:hi], weights[1:], biases[1:])
            assert all(torch.equal(p, f[lo:hi]) for p, f in zip(part, full))
    batched = kernels.blocked_linear(x.view(1, 37, -1), weights[2:])[0]  # leading dims kept
    assert batched.shape == (1, 37, 40) and torch.equal(batched[0], kernels.blocked_linear(x, weights[2:])[0])
    with pytest.raises(ValueError, match="float32"):
        kernels.blocked_linear(x, [weights[0].double()])
    for in_features in (64, 320):  # int4 matrices, widened panel by panel, beside a float32 one
        x = torch.randn(37, in_features)
        quantized, dense, bias = kernels.Int4Matrix.quantize(torch.randn(40, in_features)), torch.randn(9, in_features), torch.randn(40)
        full = kernels.blocked_linear(x, [quantized, dense], [bias, None])
        torch.testing.assert_close(full[0], x @ quantized.dequantize().T + bias, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(full[1], x @ dense.T, atol=1e-4, rtol=1e-4)
        assert torch.equal(kernels.blocked_linear(x[3:10], [quantized], [bias])[0], full[0][3:10])


@pytest.mark.skipif(not (kernels.available() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")),
                    reason="panel matrices need AVX2+FMA")
def test_panel_matrix_small_passes_are_the_prefill_gemm_bit_for_bit():
    """A `PanelMatrix` holds the float32 matrix's numbers; a small pass of any width (one or two rows
    take two panels at once, 7+ rows several passes over a block) gives each row bitwise what the
    prefill GEMM gives it, so a token's numbers do not depend on whether it was prefilled, verified
    in a batch of drafts or decoded alone. Tails in n (16-row panels) and k (256-long blocks)."""
    torch.manual_seed(1)
    for out_features, in_features in ((40, 300), (16, 256), (7, 5), (100, 513)):
        dense, bias = torch.randn(out_features, in_features), torch.randn(out_features)
        panels = kernels.PanelMatrix.pack(dense)
        assert panels.shape == dense.shape and torch.equal(panels.dequantize(), dense)
        assert torch.equal(panels[[3, 0, out_features - 1]].dequantize(), dense[[3, 0, out_features - 1]])
        x = torch.randn(kernels.MAX_ROWS, in_features)
        for b in (bias, None):
            prefill = kernels.blocked_linear(x, [panels], [b])[0]
            assert torch.equal(prefill, kernels.blocked_linear(x, [dense], [b])[0])  # in place = packed per call
            for rows in range(1, kernels.MAX_ROWS + 1):
                assert torch.equal(kernels.rowwise_linear(x[:rows], panels, b), prefill[:rows]), rows


@needs_kernels
@pytest.mark.parametrize("isa", [512, 256])
def test_slot_attention_matches_masked_softmax(isa, monkeypatch):
    if isa > kernels.isa():
        pytest.skip(f"CPU lacks the {isa}-bit kernel")
    use_kernels(monkeypatch, isa=isa)
    torch.manual_seed(0)
    batch, width, heads, kv_heads, dim, start, capacity = 2, 3, 4, 2, 16, 20, 48
    q = torch.randn(batch, width, heads, dim)
    values = torch.randn(batch, kv_heads, capacity, dim)
    keys = torch.randn(batch, kv_heads, capacity, dim)
    # the kernel's layout: blocks of 16 slots, d-major inside [B, KVH, capacity / 16, D, 16]
    keys_dmajor = keys.view(batch, kv_heads, capacity // 16, 16, dim).transpose(-1, -2).contiguous()
    visible = torch.ones(batch, start + width, dtype=torch.bool)
    visible[0, 1:3] = False  # holes
    visible[0, start + 1] = False  # a padding token inside the pass
    visible[1, :4] = False  # left padding
    out = kernels.slot_attention(q, keys_dmajor, values, visible, start, dim**-0.5)
    slot = torch.arange(start + width)
    for b in range(batch):
        for t in range(width):
            seen = visible[b] & (slot <= start + t)
            for h in range(heads):
                kv = h // (heads // kv_heads)
                k, v = keys[b, kv, : start + width][seen], values[b, kv, : start + width][seen]
                p = torch.softmax(k @ q[b, t, h] * dim**-0.5, 0)
                torch.testing.assert_close(out[b, t, h], p @ v, atol=1e-5, rtol=1e-5)
            # the same query alone, at its own slot: bitwise the same
            one = kernels.slot_attention(q[b : b + 1, t : t + 1].contiguous(), keys_dmajor[b : b + 1].contiguous(),
                                         values[b : b + 1].contiguous(), visible[b : b + 1], start + t, dim**-0.5)
            assert torch.equal(one[0, 0], out[b, t])
    nothing = torch.zeros(1, 2, dtype=torch.bool)  # a padding query with no visible slot: zeros, not NaN
    padded = kernels.slot_attention(q[:1, :2].contiguous(), keys_dmajor[:1].contiguous(), values[:1].contiguous(), nothing, 0, 0.25)
    assert torch.equal(padded, torch.zeros(1, 2, heads, dim))


@needs_kernels
@pytest.mark.parametrize("isa", [512, 256])
def test_glue_kernels_match_torch(isa, monkeypatch):
    if isa > kernels.isa():
        pytest.skip(f"CPU lacks the {isa}-bit kernel")
    use_kernels(monkeypatch, isa=isa)
    torch.manual_seed(0)
    x, delta, weight = torch.randn(5, 72), torch.randn(5, 72), torch.randn(72)
    expected_x = x + delta
    expected = weight * (expected_x * torch.rsqrt(expected_x.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = kernels.rms_norm(x, weight, 1e-6, torch.empty(5, 72), residual=delta)
    assert torch.equal(x, expected_x)  # the residual is added in place
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    gate, up = torch.randn(3, 37) * 4, torch.randn(3, 37)
    torch.testing.assert_close(kernels.silu_mul_(gate.clone(), up), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-5)
