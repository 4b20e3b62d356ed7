"""The real smollm2-135m (from the zoo): exactness on a real model, text, chat and stop sequences."""

from __future__ import annotations

import copy

import pytest
import torch

import verispec
from verispec import zoo
from verispec.models.hf import HFCausalLM

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "List the planets of the solar system in order: Mercury, Venus,",
]


@pytest.fixture(scope="module")
def smollm():
    torch.set_num_threads(2)
    zoo.pull("smollm2-135m")
    return verispec.load("smollm2-135m")


@pytest.fixture(scope="module")
def bf16_draft(smollm):
    """Self-speculation with a lower-precision copy: the same weights in bfloat16 draft for the fp32 target."""
    return HFCausalLM(copy.deepcopy(smollm.hf_model).to(torch.bfloat16), smollm.tokenizer, name="smollm2-135m-bf16")


@pytest.fixture(scope="module")
def plain_outputs(smollm):
    return [verispec.generate(smollm, p, drafter="none", max_new_tokens=40).token_ids for p in PROMPTS]


def test_plain_engine_matches_transformers(smollm, plain_outputs):
    for prompt, expected in zip(PROMPTS, plain_outputs):
        ids = smollm.tokenizer(prompt, return_tensors="pt")
        out = smollm.hf_model.generate(**ids, max_new_tokens=40, do_sample=False, eos_token_id=sorted(smollm.eos_token_ids))
        assert out[0, ids["input_ids"].shape[1]:].tolist() == expected


@pytest.mark.parametrize("draft_len", [1, 2, 3, 5, 8, "auto"])
def test_lower_precision_draft_is_exact(smollm, bf16_draft, plain_outputs, draft_len):
    for prompt, expected in zip(PROMPTS, plain_outputs):
        result = verispec.generate(smollm, prompt, draft=bf16_draft, draft_len=draft_len, max_new_tokens=40)
        assert result.token_ids == expected
    if draft_len != "auto":
        assert result.stats.mean_accepted_tokens > 1.3  # the bf16 copy agrees often: real speculation happened


def test_int8_draft_with_tree_alternates_is_exact(smollm, plain_outputs):
    """draft_len="tree" on the real model: a quantized draft (often wrong) with alternates, outputs unchanged."""
    draft = verispec.load(smollm.hf_model, tokenizer=smollm.tokenizer, weight_dtype="int8")
    for prompt, expected in zip(PROMPTS, plain_outputs):
        assert verispec.generate(smollm, prompt, draft=draft, draft_len="tree", max_new_tokens=40).token_ids == expected
    batch = verispec.generate(smollm, PROMPTS, draft=draft, draft_len="tree", max_new_tokens=40)
    assert [r.token_ids for r in batch] == plain_outputs


@pytest.mark.parametrize("draft_len", [1, 4, 8])
def test_ngram_is_exact(smollm, plain_outputs, draft_len):
    for prompt, expected in zip(PROMPTS, plain_outputs):
        assert verispec.generate(smollm, prompt, drafter="ngram", draft_len=draft_len, max_new_tokens=40).token_ids == expected


def test_batch_equals_each_alone(smollm, bf16_draft, plain_outputs):
    results = verispec.generate(smollm, PROMPTS, draft=bf16_draft, draft_len=4, max_new_tokens=40)
    assert [r.token_ids for r in results] == plain_outputs
    results = verispec.generate(smollm, PROMPTS, drafter="ngram", draft_len=3, max_new_tokens=40)
    assert [r.token_ids for r in results] == plain_outputs


def test_chat_stops_at_end_of_turn(smollm, bf16_draft):
    plain = verispec.generate(smollm, "What is the capital of France?", chat=True, drafter="none", max_new_tokens=60)
    spec = verispec.generate(smollm, "What is the capital of France?", chat=True, draft=bf16_draft, max_new_tokens=60)
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in smollm.eos_token_ids
    assert spec.token_ids == plain.token_ids
    assert "Paris" in spec.text and "<|im_end|>" not in spec.text


def test_stop_sequence_cuts_text_and_tokens(smollm, bf16_draft):
    prompt = PROMPTS[2]
    full = verispec.generate(smollm, prompt, drafter="none", max_new_tokens=40)
    stop = full.text.strip().split()[2]  # a word that appears in the output
    result = verispec.generate(smollm, prompt, draft=bf16_draft, max_new_tokens=40, stop=[stop])
    assert result.finish_reason == "stop"
    assert stop not in result.text
    assert full.text.startswith(result.text)
    assert result.token_ids == full.token_ids[: len(result.token_ids)]


def test_stream_text_equals_generate_text(smollm, bf16_draft):
    result = verispec.generate(smollm, PROMPTS[0], draft=bf16_draft, max_new_tokens=40)
    chunks = list(verispec.stream(smollm, PROMPTS[0], draft=bf16_draft, max_new_tokens=40))
    assert "".join(c.text for c in chunks) == result.text


def test_sampled_speculation_runs_and_is_seeded(smollm, bf16_draft):
    # A fixed draft length: with draft_len="auto" the lengths follow measured timings, and a different
    # length spends the seeded random stream differently (an equally exact sample, not the same one).
    options = dict(draft=bf16_draft, draft_len=4, temperature=0.7, top_p=0.9, seed=1, max_new_tokens=24)
    a = verispec.generate(smollm, PROMPTS[1], **options)
    b = verispec.generate(smollm, PROMPTS[1], **options)
    assert a.token_ids == b.token_ids and a.stats.accepted_tokens > 0
