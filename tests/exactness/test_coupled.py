"""Coupled sampling (Gumbel-max with noise keyed by seed and position) must sample the target's
distribution exactly and give a seeded request the same tokens whatever drafted them.

Chi-square tests as in test_sampling_exactness; the engine tests compare token ids with plain
sampling under the same seed, and a negative control shows that speculative sampling's output does
depend on the draft length, so the equality is a property of the coupling and not of the test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import perturbed_copy, tiny_llama
from test_sampling_exactness import P_THRESHOLD, chi2_pvalue, first_two_tokens_pvalues, reference_probs, repeating_prompt

import verispec
from verispec import sampling as sampling_module
from verispec.drafters.base import Draft
from verispec.sampling import SamplingParams, coupled_choice, warp
from verispec.verifiers import CoupledVerifier, verifier_for

N = 30000


@pytest.mark.parametrize("head_min", [1e-6, 0.08], ids=["default-head", "big-tail"])
def test_coupled_choice_follows_probs(head_min, monkeypatch):
    """Each position's race is a draw from probs, also when tokens below the head threshold win as an
    aggregate (head_min=0.08 puts a third of the mass there)."""
    monkeypatch.setattr(sampling_module, "COUPLING_HEAD_MIN", head_min)
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.07, 0.06, 0.05, 0.04, 0.03, 0.0])
    draws = np.array([coupled_choice(probs, seed=3, position=n) for n in range(N)])
    assert chi2_pvalue(draws, probs.double().numpy()) > P_THRESHOLD
    # a function of (seed, position) only
    assert [coupled_choice(probs, 3, n) for n in range(50)] == draws[:50].tolist()
    assert [coupled_choice(probs, 4, n) for n in range(50)] != draws[:50].tolist()


def test_coupled_choice_negative_control_is_caught():
    """The same statistic rejects a race that ignores the tail (a wrong aggregate)."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    draws = np.array([int(torch.tensor([0.5, 0.3, 0.0]).argmax()) if coupled_choice(probs, 3, n) == 2 else coupled_choice(probs, 3, n)
                      for n in range(5000)])
    assert chi2_pvalue(draws, probs.double().numpy()) < 1e-10


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, coupled=True),
                                    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, coupled=True)], ids=str)
def test_coupled_verifier_follows_target_and_ignores_the_draft(params):
    """N rows (seed = row) verify a 2-token draft drawn from a related q with the row's noise: the first
    and second emitted tokens follow p, and every emitted token is the one plain sampling with that seed
    picks at its position, whatever the draft was."""
    gen = torch.Generator().manual_seed(7)
    vocab, k = 10, 2
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    q = warp(target_logits[:k] + torch.randn(k, vocab, generator=gen), params)
    p = warp(target_logits, params)
    tokens = torch.tensor([[coupled_choice(q[i], seed, i) for i in range(k)] for seed in range(N)])
    draft = Draft(tokens=tokens, num_drafted=torch.full((N,), k), probs=q.expand(N, k, vocab))
    rows = [SamplingParams(params.temperature, params.top_k, params.top_p, seed=s, coupled=True) for s in range(N)]
    assert isinstance(verifier_for(rows), CoupledVerifier)
    verdict = CoupledVerifier().verify(draft, target_logits.expand(N, k + 1, vocab), rows, [None] * N, positions=[0] * N)
    emitted = [verdict.emitted(draft, b) for b in range(N)]
    reference = [reference_probs(target_logits[i].numpy(), params.temperature, params.top_k, params.top_p) for i in range(k + 1)]
    assert chi2_pvalue(np.array([e[0] for e in emitted]), reference[0]) > P_THRESHOLD
    second = np.array([e[1] for e in emitted if len(e) >= 2])
    assert chi2_pvalue(second, reference[1]) > P_THRESHOLD
    accepted = float(verdict.num_accepted.float().mean())
    assert 0.3 < accepted < k  # the drafts agree often, not always
    for seed in range(0, N, 997):  # drafter invariance: plain sampling's token at each emitted position
        assert emitted[seed] == [coupled_choice(p[i], seed, i) for i in range(len(emitted[seed]))]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0)
    return target, perturbed_copy(target, scale=0.3)


DRAFTS = [dict(drafter="model", draft_len=1), dict(drafter="model", draft_len=4), dict(drafter="model", draft_len="auto"),
          dict(drafter="ngram", draft_len=3), dict(drafter="hybrid", draft_len=3)]


@pytest.mark.parametrize("options", DRAFTS, ids=lambda o: f"{o['drafter']}-{o['draft_len']}")
def test_coupled_output_is_plain_sampling_output(pair, options):
    """With coupled=True a seeded call returns the tokens plain sampling returns for that seed."""
    target, draft = pair
    prompt = repeating_prompt(target)
    common = dict(temperature=0.9, top_p=0.95, coupled=True, max_new_tokens=24)
    accepted = 0
    for seed in range(4):
        plain = verispec.generate(target, prompt, drafter="none", seed=seed, **common)
        spec = verispec.generate(target, prompt, draft=draft, seed=seed, **options, **common)
        assert spec.token_ids == plain.token_ids, f"seed {seed}"
        accepted += spec.stats.accepted_tokens
    assert accepted > 0  # the draft's tokens were used, not only the target's
    # a batch: row b is the lone call with seed + b
    batch = verispec.generate(target, [prompt] * 3, draft=draft, seed=10, **options, **common)
    for b, result in enumerate(batch):
        assert result.token_ids == verispec.generate(target, prompt, drafter="none", seed=10 + b, **common).token_ids


def test_negative_control_speculative_sampling_depends_on_the_draft_length(pair):
    """Without coupling, the same seed at two draft lengths gives different (equally exact) samples."""
    target, draft = pair
    prompt = repeating_prompt(target)
    common = dict(draft=draft, temperature=0.9, top_p=0.95, max_new_tokens=24)
    differ = [verispec.generate(target, prompt, draft_len=1, seed=s, **common).token_ids
              != verispec.generate(target, prompt, draft_len=4, seed=s, **common).token_ids for s in range(4)]
    assert any(differ)


def test_coupled_engine_samples_target_distribution(pair):
    """End to end: over 2000 seeded rows the first two coupled tokens follow p(t1) p(t2 | t1)."""
    target, draft = pair
    prompt = repeating_prompt(target)
    params = SamplingParams(temperature=0.8, seed=11, coupled=True)
    results = verispec.generate(target, [prompt] * 2000, draft=draft, draft_len=3, temperature=params.temperature,
                                seed=params.seed, coupled=True, max_new_tokens=3)
    assert results[0].stats.accepted_tokens > 10
    first, joint = first_two_tokens_pvalues(target, prompt, params, [r.token_ids for r in results])
    assert first > P_THRESHOLD and joint > P_THRESHOLD


def test_unseeded_coupled_call_runs():
    """Without a seed the engine draws one per request: a normal run (it may end at EOS)."""
    target = tiny_llama(seed=0)
    result = verispec.generate(target, [1, 5, 6], draft=perturbed_copy(target, scale=0.3), temperature=0.9, coupled=True,
                               max_new_tokens=8)
    assert 1 <= len(result.token_ids) <= 8
    assert len(result.token_ids) == 8 or result.finish_reason == "stop"


def test_coupled_must_be_a_bool():
    with pytest.raises(verispec.VerispecError, match="coupled"):
        SamplingParams(temperature=1.0, coupled="yes")
