"""Greedy speculative decoding must give exactly the target's own greedy tokens, for every drafter."""

from __future__ import annotations

import pytest
import torch

import verispec
from conftest import EOS

PROMPTS = [[1, 5, 6, 7, 8, 9, 5, 6, 7], [1, 20, 21], [4], [1, 30, 31, 32, 30, 31, 32, 30, 31, 40, 41, 42]]


_PLAIN: dict = {}


def plain(target, prompt, max_new_tokens):
    """Plain greedy decoding through the same engine (memoized: the tiny models never change). Each entry
    holds its model, so no later model can take over its id while the entry lives."""
    key = (id(target), target.eos_token_ids, tuple(prompt), max_new_tokens)
    if key not in _PLAIN:
        _PLAIN[key] = (target, verispec.generate(target, prompt, drafter="none", max_new_tokens=max_new_tokens).token_ids)
    return _PLAIN[key][1]


def hf_greedy(target, prompt, max_new_tokens):
    """An independent reference: transformers' own greedy generate()."""
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_plain_engine_matches_transformers_generate(tiny_pair):
    target, _ = tiny_pair
    for prompt in PROMPTS:
        assert plain(target, prompt, 48) == hf_greedy(target, prompt, 48)


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("draft_len", [*range(1, 9), "auto"])
def test_speculative_equals_plain_batch1(tiny_pair, drafter, draft_len):
    target, draft = tiny_pair
    for prompt in PROMPTS:
        expected = plain(target, prompt, 40)
        got = verispec.generate(target, prompt, draft=draft, drafter=drafter, draft_len=draft_len, max_new_tokens=40)
        assert got.token_ids == expected, f"prompt {prompt}"


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("draft_len", [1, 3, 5, 8, "auto"])
def test_speculative_batch_equals_each_alone(tiny_pair, drafter, draft_len):
    """Rows of different lengths accept different counts per step; each must decode as if alone."""
    target, draft = tiny_pair
    batch = verispec.generate(target, PROMPTS, draft=draft, drafter=drafter, draft_len=draft_len, max_new_tokens=40)
    assert [r.token_ids for r in batch] == [plain(target, p, 40) for p in PROMPTS]


def test_speculation_actually_accepts(tiny_pair):
    """Guard against a vacuous pass: the draft model must get tokens accepted, several at a time."""
    target, draft = tiny_pair
    saved, target.eos_token_ids = target.eos_token_ids, frozenset()  # run the full length
    try:
        result = verispec.generate(target, PROMPTS[0], draft=draft, draft_len=4, max_new_tokens=40)
    finally:
        target.eos_token_ids = saved
    assert result.stats.accepted_tokens > 10
    assert result.stats.mean_accepted_tokens > 1.5
    assert result.stats.target_passes < 40


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("draft_len", [1, 4, 8])
def test_max_new_tokens_is_exact(tiny_pair, max_new_tokens, draft_len):
    target, draft = tiny_pair
    eos_free = [p for p in PROMPTS if EOS not in plain(target, p, max_new_tokens)]
    results = verispec.generate(target, eos_free, draft=draft, draft_len=draft_len, max_new_tokens=max_new_tokens)
    for prompt, result in zip(eos_free, results):
        assert len(result.token_ids) == max_new_tokens
        assert result.token_ids == plain(target, prompt, max_new_tokens)
        assert result.finish_reason == "length"


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
def test_stops_at_eos_inside_an_accepted_draft(tiny_pair, drafter):
    """Make a token that plain decoding emits mid-sequence the EOS: both must stop right after it."""
    target, draft = tiny_pair
    reference = plain(target, PROMPTS[0], 40)
    eos = reference[6]
    saved = target.eos_token_ids
    target.eos_token_ids = frozenset({eos})
    try:
        expected = plain(target, PROMPTS[0], 40)
        assert expected[-1] == eos and len(expected) == reference.index(eos) + 1
        for draft_len in (1, 4, 8):
            got = verispec.generate(target, PROMPTS[0], draft=draft, drafter=drafter, draft_len=draft_len, max_new_tokens=40)
            assert got.token_ids == expected
            assert got.finish_reason == "stop"
    finally:
        target.eos_token_ids = saved


def test_streaming_yields_the_same_tokens(tiny_pair):
    target, draft = tiny_pair
    chunks = list(verispec.stream(target, PROMPTS[0], draft=draft, draft_len=4, max_new_tokens=30))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == plain(target, PROMPTS[0], 30)
    assert chunks[-1].finish_reason in ("length", "stop")
    assert any(any(c.from_draft) for c in chunks)


@pytest.mark.parametrize("confidence", [0.3, 0.6, 0.9])
def test_confidence_early_stop_is_exact_and_drafts_less(tiny_pair, confidence):
    target, draft = tiny_pair
    full = verispec.generate(target, PROMPTS, draft=draft, draft_len=6, max_new_tokens=40)
    results = verispec.generate(target, PROMPTS, draft=draft, draft_len=6, max_new_tokens=40, draft_confidence=confidence)
    assert [r.token_ids for r in results] == [plain(target, p, 40) for p in PROMPTS]
    assert results[0].stats.mean_draft_len < full[0].stats.mean_draft_len


def test_cheap_draft_variants_stay_exact(tiny_pair):
    """int8 weights and a restricted vocabulary change the draft, never the output."""
    from verispec.models.draft_variants import quantize_int8, restrict_vocabulary

    target, draft = tiny_pair
    for variant in (quantize_int8(draft), restrict_vocabulary(draft, 48), quantize_int8(restrict_vocabulary(draft, 60))):
        for temperature in (0.0,):
            results = verispec.generate(target, PROMPTS, draft=variant, draft_len=4, max_new_tokens=30, temperature=temperature)
            assert [r.token_ids for r in results] == [plain(target, p, 30) for p in PROMPTS]
            assert results[0].stats.accepted_tokens > 0
    restricted = restrict_vocabulary(draft, 48)
    draft_tokens = verispec.generate(restricted, PROMPTS[0], drafter="none", max_new_tokens=30).token_ids
    assert all(t < 48 or t in restricted.eos_token_ids for t in draft_tokens)


@pytest.mark.parametrize("drafter", ["model", "ngram", "none"])
def test_batch_reused_after_it_emptied(tiny_pair, drafter):
    """Rows join a DecodeBatch whose earlier rows all left: they must decode as if alone."""
    from verispec.api import make_drafter
    from verispec.engine import DecodeBatch, Request
    from verispec.policy import FixedDraftLen

    target, draft = tiny_pair
    batch = DecodeBatch(target, make_drafter(target, draft, drafter), FixedDraftLen(3))
    batch.add([Request(PROMPTS[0], max_new_tokens=20, id="first")])
    batch.step()
    batch.remove("first")
    batch.add([Request(PROMPTS[1], max_new_tokens=20, id="second")])
    tokens = []
    while len(batch):
        tokens += [t for e in batch.step() for t in e.tokens]
    assert tokens == plain(target, PROMPTS[1], 20)


def test_hybrid_uses_lookup_and_model_and_stays_exact(tiny_pair):
    """On text that repeats itself the hybrid drafts by lookup; elsewhere with the model, which then
    catches up on what it skipped. Both kinds of step must leave the output unchanged."""
    from verispec.drafters import HybridDrafter, ModelDrafter
    from verispec.engine import Request, SpeculativeEngine

    target, draft = tiny_pair
    opening = [1, 5, 6, 7]
    prompt = opening + plain(target, opening, 12) + opening  # the target will continue as it did before
    drafters = []

    def make():
        drafters.append(HybridDrafter(ModelDrafter(draft, target.vocab_size), max_lag=8))
        return drafters[-1]

    engine = SpeculativeEngine(target, make, draft_len=3)
    tokens = [t for e in engine.stream([Request(prompt=prompt, max_new_tokens=40, id=0)]) for t in e.tokens]
    assert tokens == plain(target, prompt, 40)
    hybrid = drafters[0]
    assert hybrid.lookup_steps > 0 and hybrid.model_steps > 0
