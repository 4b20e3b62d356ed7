"""Block verification must emit text distributed exactly as the target's, and accept at least as much.

First by exact enumeration: small vocabularies, distributions that depend on the whole prefix (with
zeros, and contexts where the draft equals the target), every draft block and every stopping point
weighed by its probability, compared with the target's probability of each continuation. A plausible
slip in the rule (the previous weight in the stopping chance) fails the same check. Then by sampling,
through the real verifier and the engine on a tiny model.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import verispec
from conftest import perturbed_copy, tiny_llama
from test_sampling_exactness import (P_THRESHOLD, VOCAB, chi2_pvalue, first_two_tokens_pvalues, reference_probs, repeating_prompt,
                                     run_verifier, situation)
from verispec.drafters.base import Draft
from verispec.sampling import SamplingParams, make_generators, warp
from verispec.verifiers import BlockVerifier, SpeculativeSamplingVerifier, verifier_for
from verispec.verifiers.base import residual
from verispec.verifiers.block import block_weights


class Tree:
    """Random target and draft distributions over `vocab` tokens for every prefix, made on first use."""

    def __init__(self, seed: int, vocab: int = 3):
        self.rng, self.vocab, self.p, self.q = np.random.default_rng(seed), vocab, {}, {}

    def _random(self) -> np.ndarray:
        d = self.rng.random(self.vocab) ** 3
        if self.rng.random() < 0.3:
            d[self.rng.integers(self.vocab)] = 0.0
        return d / d.sum()

    def target(self, prefix: tuple) -> np.ndarray:
        if prefix not in self.p:
            self.p[prefix] = self._random()
        return self.p[prefix]

    def draft(self, prefix: tuple) -> np.ndarray:
        if prefix not in self.q:
            self.q[prefix] = self.target(prefix).copy() if self.rng.random() < 0.3 else self._random()
        return self.q[prefix]


def completer(tree: Tree, length: int, out: dict):
    """complete(tokens, prob): add to out[...] the chance prob of having emitted `tokens`, extended by the
    target's own draws to `length` tokens (a step's output, followed by plain decoding)."""

    def complete(tokens: tuple, prob: float) -> None:
        if len(tokens) == length:
            out[tokens] = out.get(tokens, 0.0) + prob
            return
        for a, pa in enumerate(tree.target(tokens)):
            if pa > 0:
                complete(tokens + (a,), prob * pa)

    return complete


def drafted_blocks(tree: Tree, g: int):
    """Every draft block of g tokens the draft can propose: (block, its chance, p [g + 1, V] the target's
    distributions along it, q [g, V] the draft's)."""
    for block in itertools.product(range(tree.vocab), repeat=g):
        drafted = np.prod([tree.draft(block[:i])[block[i]] for i in range(g)])
        if drafted == 0:
            continue
        p = torch.tensor(np.stack([tree.target(block[:i]) for i in range(g + 1)]))
        q = torch.tensor(np.stack([tree.draft(block[:i]) for i in range(g)]))
        yield block, drafted, p, q


def block_stops(p, q, block, weights=block_weights):
    """(kept, its chance given the block, the distribution of the target's token there) for each prefix
    length block verification may keep."""
    w, h = weights(p, q, torch.tensor(block))
    g, not_longer = len(block), 1.0  # the chance that no longer prefix was kept
    for kept in range(g, -1, -1):
        chance = not_longer * float(h[kept])
        not_longer *= 1 - float(h[kept])
        yield kept, chance, (p[g] if kept == g else residual(float(w[kept]), p[kept], q[kept]))


def emitted_distribution(tree: Tree, g: int, weights=block_weights) -> tuple[dict, float]:
    """Exact probability of each first g + 1 tokens one block-verified step (completed by the target)
    emits, and the expected number of accepted draft tokens."""
    out, accepted = {}, 0.0
    complete = completer(tree, g + 1, out)
    for block, drafted, p, q in drafted_blocks(tree, g):
        for kept, chance, dist in block_stops(p, q, block, weights):
            chance *= drafted
            if chance == 0:
                continue
            accepted += chance * kept
            for y, py in enumerate(dist.tolist()):
                if py > 0:
                    complete(block[:kept] + (y,), chance * py)
    return out, accepted


def target_probability(tree: Tree, tokens: tuple) -> float:
    return float(np.prod([tree.target(tokens[:i])[tokens[i]] for i in range(len(tokens))]))


def token_rule_accepted(tree: Tree, g: int) -> float:
    """Expected accepted draft tokens of token-by-token speculative sampling on the same tree."""
    total = 0.0
    for block in itertools.product(range(tree.vocab), repeat=g):
        drafted = np.prod([tree.draft(block[:i])[block[i]] for i in range(g)])
        survive = 1.0
        for i in range(g):
            p, q = tree.target(block[:i])[block[i]], tree.draft(block[:i])[block[i]]
            survive *= min(1.0, p / q) if q > 0 else 0.0
            total += drafted * survive
    return total


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("g", [1, 2, 3])
def test_block_verification_is_exact_by_enumeration(seed, g):
    tree = Tree(seed)
    out, accepted = emitted_distribution(tree, g)
    for tokens in itertools.product(range(tree.vocab), repeat=g + 1):
        assert out.get(tokens, 0.0) == pytest.approx(target_probability(tree, tokens), abs=1e-12)
    # Optimal among exact rules, so never below token by token (equal for one draft token).
    token_rule = token_rule_accepted(tree, g)
    assert accepted >= token_rule - 1e-12
    if g == 1:
        assert accepted == pytest.approx(token_rule)


def test_enumeration_catches_a_wrong_stopping_chance():
    """Negative control: the stopping chance computed with the previous weight w_{i-1} instead of w_i."""

    def slipped(p, q, tokens):
        w, h = block_weights(p, q, tokens)
        g = tokens.shape[0]
        mass = (w[: g - 1, None] * p[1:g].double() - q[1:g].double()).clamp(min=0).sum(1)
        h[1:g] = mass / (mass + 1 - w[: g - 1]).clamp(min=1e-300)
        return w, h

    worst = 0.0
    for seed in range(6):
        tree = Tree(seed)
        out, _ = emitted_distribution(tree, 3, weights=slipped)
        worst = max(worst, max(abs(out.get(t, 0.0) - target_probability(tree, t)) for t in itertools.product(range(3), repeat=4)))
    assert worst > 1e-3


def test_block_verifier_samples_the_target_and_accepts_more():
    """The real verifier on N draws of one situation: first and second tokens follow p; more is accepted."""
    params = SamplingParams(temperature=1.0)
    target_logits, draft_logits = situation(seed=7, k=4)
    q = warp(draft_logits, params)
    emitted, verdict = run_verifier(BlockVerifier(), target_logits, q, params)
    p = [reference_probs(target_logits[i].numpy(), 1.0) for i in range(2)]
    assert chi2_pvalue(np.array([e[0] for e in emitted]), p[0]) > P_THRESHOLD
    second = np.array([e[1] for e in emitted if len(e) >= 2])
    assert len(second) > 1000 and chi2_pvalue(second, p[1]) > P_THRESHOLD
    _, token_verdict = run_verifier(SpeculativeSamplingVerifier(), target_logits, q, params)
    block, token = float(verdict.num_accepted.float().mean()), float(token_verdict.num_accepted.float().mean())
    assert block > token + 0.02, (block, token)  # ~30000 draws each: the gap is far above the noise


def test_greedy_rows_get_the_argmax_chain():
    logits = torch.randn(3, 5, VOCAB, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1)
    tokens = best[:, :4].clone()
    tokens[1, 2] = (tokens[1, 2] + 1) % VOCAB  # row 1 goes wrong at position 2
    tokens[2, 0] = (tokens[2, 0] + 1) % VOCAB  # row 2 at once
    probs = torch.nn.functional.one_hot(tokens, VOCAB).float()
    greedy = SamplingParams()
    verdict = BlockVerifier().verify(Draft(tokens, torch.full((3,), 4), probs), logits, [greedy] * 3, make_generators(greedy, 3))
    assert verdict.num_accepted.tolist() == [4, 2, 0]
    assert verdict.next_tokens.tolist() == [int(best[0, 4]), int(best[1, 2]), int(best[2, 0])]


def test_sampled_rows_verify_by_blocks_unless_asked_otherwise():
    sampled = SamplingParams(temperature=0.8)
    assert isinstance(verifier_for([sampled, SamplingParams()]), BlockVerifier)
    assert isinstance(verifier_for([SamplingParams(temperature=0.8, blockwise=False)]), SpeculativeSamplingVerifier)
    with pytest.raises(verispec.VerispecError, match="blockwise"):
        SamplingParams(blockwise="yes")


@pytest.mark.parametrize("blockwise", [True, False])
def test_engine_samples_the_target_either_way(blockwise):
    """Context-dependent distributions of a real (tiny) model, drafts of 4, block or token-by-token rule
    (test_sampling_exactness covers the default, blocks, with other drafters and settings): the first two
    tokens of 2000 sampled continuations follow the target's own distribution."""
    params = SamplingParams(temperature=0.8, seed=11)
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.3)
    prompt = repeating_prompt(target)
    results = verispec.generate(target, [prompt] * 2000, draft=draft, draft_len=4, temperature=params.temperature,
                                seed=params.seed, blockwise=blockwise, max_new_tokens=2)
    first, second = first_two_tokens_pvalues(target, prompt, params, [r.token_ids for r in results])
    assert first > P_THRESHOLD and second > P_THRESHOLD
    assert results[0].stats.accepted_tokens > 100
