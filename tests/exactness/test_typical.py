"""Typical acceptance (Medusa's rule) is a lossy opt-in: it must do what it says, stay off for rows that did
not ask for it, keep greedy decoding exact, and visibly not sample the target's distribution."""

from __future__ import annotations

import math

import pytest
import torch

import verispec
from conftest import perturbed_copy, tiny_llama
from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
from verispec.drafters.base import Draft
from verispec.sampling import SamplingParams, warp
from verispec.verifiers import BlockVerifier, GreedyVerifier, TypicalVerifier, verifier_for
from verispec.verifiers.typical import typical_bar


def test_bar_is_min_of_eps_and_entropy_term():
    uniform = torch.full((8,), 1 / 8)  # H = ln 8: sqrt(eps) / 8
    assert typical_bar(uniform, 0.09).item() == pytest.approx(0.3 / 8)
    sure = torch.tensor([1.0, 0.0, 0.0])  # H = 0: sqrt(eps) > eps, so the bar is eps
    assert typical_bar(sure, 0.09).item() == pytest.approx(0.09)
    p = torch.tensor([0.7, 0.2, 0.1])
    entropy = -sum(x * math.log(x) for x in p.tolist())
    assert typical_bar(p, 0.25).item() == pytest.approx(min(0.25, 0.5 * math.exp(-entropy)))


def test_keeps_the_longest_run_above_the_bar_then_samples_p_there():
    """Position 0: p(x) = 0.5 (kept); position 1: p(x) = 0.02 under a bar of ~0.09 (refused): one token is
    kept, and the target's own token at position 1 comes from p there (all its mass on token 3)."""
    vocab, eps = 6, 0.09
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.02, 0.98, 0.0, 0.0],
                      [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]])
    logits = p.clamp(min=1e-30).log()[None]
    draft = Draft(tokens=torch.tensor([[0, 2]]), num_drafted=torch.tensor([2]))
    sampling = [SamplingParams(temperature=1.0, typical_acceptance=eps)]
    verifier = verifier_for(sampling)
    assert isinstance(verifier, TypicalVerifier) and not verifier.lossless
    assert typical_bar(warp(logits[0, 1], sampling[0]), eps) > 0.02
    verdict = verifier.verify(draft, logits, sampling, [torch.Generator().manual_seed(0)])
    assert verdict.num_accepted.tolist() == [1] and verdict.next_tokens.tolist() == [3]
    # A full draft above the bar is kept whole, and the bonus token comes from p after it.
    full = Draft(tokens=torch.tensor([[0, 3]]), num_drafted=torch.tensor([2]))
    bonus = verifier.verify(full, logits, sampling, [torch.Generator().manual_seed(0)])
    assert bonus.num_accepted.tolist() == [2]


def test_other_rows_keep_their_exact_rule_and_greedy_rows_stay_greedy():
    """A batch of a typical row, a sampled row that did not opt in, and a greedy row: the second gets exactly
    what block verification gives it alone (same random stream), the third exactly the argmax chain."""
    torch.manual_seed(0)
    vocab, k = 40, 4
    logits = torch.randn(3, k + 1, vocab) * 2
    q = torch.softmax(torch.randn(3, k, vocab), -1)
    tokens = torch.stack([torch.multinomial(q[b], 1).squeeze(1) for b in range(3)])
    tokens[2] = logits[2, :k].argmax(-1)
    tokens[2, 2] = (tokens[2, 2] + 1) % vocab  # the greedy row's chain breaks at position 2
    draft = Draft(tokens=tokens, num_drafted=torch.tensor([k, k, k]), probs=q)
    sampling = [SamplingParams(temperature=1.0, typical_acceptance=0.09), SamplingParams(temperature=1.0), SamplingParams()]
    verdict = verifier_for(sampling).verify(draft, logits, sampling, [torch.Generator().manual_seed(b) for b in range(3)])
    alone = BlockVerifier().verify(draft.rows(torch.tensor([1])), logits[1:2], sampling[1:2], [torch.Generator().manual_seed(1)])
    assert verdict.num_accepted[1] == alone.num_accepted[0] and verdict.next_tokens[1] == alone.next_tokens[0]
    greedy = GreedyVerifier().verify(draft.rows(torch.tensor([2])), logits[2:3], sampling[2:], [torch.Generator()])
    assert verdict.num_accepted[2] == greedy.num_accepted[0] == 2 and verdict.next_tokens[2] == greedy.next_tokens[0]
    # The other rows' rule is chosen from their own settings alone.
    mixed = verifier_for([SamplingParams(temperature=1.0, typical_acceptance=0.09, blockwise=False), SamplingParams(temperature=1.0)])
    assert isinstance(mixed.exact, BlockVerifier)
    # Without an opted-in sampled row the rule is the lossless one.
    assert verifier_for([SamplingParams(typical_acceptance=0.09)]).lossless
    assert verifier_for(sampling[1:]).lossless


def test_greedy_output_is_unchanged():
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.3)
    prompt = [1, 5, 6, 7]
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=24)
    typical = verispec.generate(target, prompt, draft=draft, draft_len=4, typical_acceptance=0.3, max_new_tokens=24)
    assert typical.token_ids == plain.token_ids
    assert not typical.stats.lossy  # greedy rows are verified exactly whatever they ask


def test_it_is_lossy_and_accepts_more():
    """On the setting where the exact rules pass (test_block_verification's engine test), typical acceptance
    keeps many more draft tokens, and the first tokens of 2000 continuations are visibly NOT distributed as
    the target's: the opt-in really changes the rule, and really is lossy."""
    params = SamplingParams(temperature=0.8, seed=11)
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.3)
    prompt = repeating_prompt(target)
    options = dict(draft=draft, draft_len=4, temperature=params.temperature, seed=params.seed, max_new_tokens=2)
    typical = verispec.generate(target, [prompt] * 2000, typical_acceptance=0.09, **options)
    exact = verispec.generate(target, [prompt] * 2000, **options)
    assert typical[0].stats.acceptance_rate > exact[0].stats.acceptance_rate + 0.1
    assert typical[0].stats.lossy and "LOSSY" in typical[0].stats.summary() and not exact[0].stats.lossy
    first, second = first_two_tokens_pvalues(target, prompt, params, [r.token_ids for r in typical])
    assert min(first, second) < P_THRESHOLD


@pytest.mark.parametrize("bad", [-0.1, 1.0, "0.1", True])
def test_bad_settings_are_refused(bad):
    with pytest.raises(verispec.VerispecError, match="typical_acceptance"):
        SamplingParams(temperature=1.0, typical_acceptance=bad)


def test_refused_with_coupling():
    with pytest.raises(verispec.VerispecError, match="coupled"):
        SamplingParams(temperature=1.0, coupled=True, typical_acceptance=0.09)
