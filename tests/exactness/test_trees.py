"""Token trees: a greedy draft's alternates (second guesses beside chain positions) verified in one pass.

Three claims:
- the pass: each tree token's logits are bitwise those of decoding its own path alone (C kernels),
  and close to them on the PyTorch path;
- the rollback: after a tree pass the cache holds exactly the accepted path;
- the output: greedy decoding with alternates is token-for-token plain greedy decoding, and the
  alternates are really taken (so the equality is not vacuous).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import on_path, perturbed_copy, prefilled, tiny_llama, tiny_qwen2
from verispec.cache import SlotCache
from verispec.drafters import ModelDrafter
from verispec.drafters.base import Draft
from verispec.engine import DecodeBatch, Request
from verispec.models.native import NativeCausalLM
from verispec.policy import AdaptiveDraftLen, ConfidenceStop
from verispec.stats import AlternateOutcome, StepRecord
from verispec.verifiers import GreedyVerifier

PREFIX = [1, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11]
PROMPTS = [[1, 5, 6, 7, 8, 9, 5, 6, 7], [1, 20, 21], [4], [1, 30, 31, 32, 30, 31, 32, 30, 31, 40, 41, 42]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(native target, native draft that is often wrong: its alternates get their chances, the HF model)."""
    hf = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param](seed=0)
    return NativeCausalLM.from_hf(hf), NativeCausalLM.from_hf(perturbed_copy(hf, scale=0.3)), hf


@pytest.fixture(params=["kernels", "torch"])
def target(request, pair, monkeypatch):
    return on_path(pair[0], request.param, monkeypatch)


def _example_draft() -> Draft:
    """A chain of 4 with alternates beside positions 0 and 2 (one row)."""
    return Draft(tokens=torch.tensor([[12, 13, 14, 15]]), num_drafted=torch.tensor([4]),
                 alternates=torch.tensor([[40, -1, 41, -1]]), alternate_confidence=torch.tensor([[0.2, 0.0, 0.3, 0.0]]))


def test_tree_layout_puts_each_alternate_beside_its_position():
    layout = _example_draft().tree
    extra, tree, parent, source = layout.extra, layout.mask, layout.parent, layout.source
    assert extra.tolist() == [[40, 41]]
    assert parent.tolist() == [[-1, 0, 1, 2, 3, 0, 2]] and source.tolist() == [[-1, -1, -1, -1, -1, 0, 2]]
    # pass: [last, 12, 13, 14, 15, 40, 41]; 40 replaces 12 (sees last), 41 replaces 14 (sees last, 12, 13)
    assert tree[0, 5].tolist() == [True, False, False, False, False, True, False]
    assert tree[0, 6].tolist() == [True, True, True, False, False, False, True]
    assert tree[0, :5, :5].equal(torch.tril(torch.ones(5, 5, dtype=torch.bool)))


def test_tree_pass_scores_each_path_as_if_alone(target):
    """Every token of a tree pass gets the logits of its own path decoded on its own."""
    draft = _example_draft()
    extra, tree = draft.tree.extra, draft.tree.mask
    tokens = torch.cat([torch.tensor([[PREFIX[-1]]]), draft.tokens, extra], 1)
    logits = target.forward(tokens, prefilled(target, PREFIX[:-1]), tree=tree)[0]
    paths = {0: [], 1: [12], 2: [12, 13], 3: [12, 13, 14], 4: [12, 13, 14, 15], 5: [40], 6: [12, 13, 41]}
    for column, path in paths.items():
        alone = target.forward(torch.tensor([[PREFIX[-1], *path]]), prefilled(target, PREFIX[:-1]))[0, -1]
        if target._kernels:
            assert torch.equal(logits[column], alone), f"column {column}: max diff {(logits[column] - alone).abs().max()}"
        else:
            torch.testing.assert_close(logits[column], alone, atol=1e-5, rtol=1e-5)


def test_retain_keeps_the_accepted_path_and_later_tokens_see_only_it(target):
    """After a tree pass that took position 0's alternate, the cache is the path [last, alternate]."""
    draft = _example_draft()
    extra, tree = draft.tree.extra, draft.tree.mask
    cache = prefilled(target, PREFIX[:-1])
    start = cache.slots.length
    target.forward(torch.cat([torch.tensor([[PREFIX[-1]]]), draft.tokens, extra], 1), cache, tree=tree)
    keep = torch.zeros(1, tree.shape[1], dtype=torch.bool)
    keep[0, [0, 5]] = True
    cache.retain(start, keep)
    assert cache.slots.num_tokens().tolist() == [len(PREFIX) + 1] and cache.slots.length == start + 6
    got = target.forward(torch.tensor([[77]]), cache)[0, -1]
    expected = target.forward(torch.tensor([[PREFIX[-1], 40, 77]]), prefilled(target, PREFIX[:-1]))[0, -1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_slot_retain_shrinks_past_the_last_kept_slot():
    slots = SlotCache(2)
    slots.extend(torch.ones(2, 3, dtype=torch.bool))
    slots.extend(torch.ones(2, 5, dtype=torch.bool))
    slots.retain(3, torch.tensor([[True, False, False, True, False], [True, True, False, False, False]]))
    assert slots.length == 7
    assert slots.visible.tolist() == [[True] * 3 + [True, False, False, True], [True] * 3 + [True, True, False, False]]
    assert slots.num_tokens().tolist() == [5, 5]


def test_greedy_verifier_takes_the_alternate_where_the_chain_breaks():
    draft = _example_draft()
    vocab = 100
    logits = torch.zeros(1, 7, vocab)
    # the target wants 12, 13, then 41 (not 14): the alternate beside position 2; after 41 it wants 55
    for column, token in [(0, 12), (1, 13), (2, 41), (3, 1), (4, 1), (5, 1), (6, 55)]:
        logits[0, column, token] = 1.0
    verdict = GreedyVerifier().verify(draft, logits, [], [])
    assert verdict.num_accepted.tolist() == [2] and verdict.alternate.tolist() == [True]
    assert verdict.emitted(draft, 0) == [12, 13, 41, 55]
    logits[0, 2] = 0
    logits[0, 2, 33] = 1.0  # neither the chain's token nor the alternate: the target's own token
    verdict = GreedyVerifier().verify(draft, logits, [], [])
    assert verdict.alternate.tolist() == [False] and verdict.emitted(draft, 0) == [12, 13, 33]


class _Everywhere:
    """A branch rule that takes every alternate: a leaf beside every position, every node of a drafter's tree
    (valued, as EAGLE-2 does, by the product of the draft's probabilities along its path)."""

    def __call__(self, confidence, num_drafted):
        return torch.ones(confidence.shape, dtype=torch.bool)

    def chance(self, confidence, chain):
        return confidence

    def pick(self, worth, width):
        return worth > 0


class _Always:
    """A policy that drafts k tokens and places an alternate at every position (every tree node)."""

    def __init__(self, k: int):
        self.k = k

    def choose(self, batch_size):
        return self.k

    def stop_rule(self, batch_size):
        return lambda position, confidence: torch.ones(confidence.shape[0], dtype=torch.bool)

    def branch_rule(self, stop):
        return _Everywhere()

    def observe(self, *args, **kwargs):
        pass


def _decode(target, drafter, prompts, policy, max_new_tokens=30):
    batch = DecodeBatch(target, drafter, policy)
    requests = [Request(prompt=p, max_new_tokens=max_new_tokens, id=i) for i, p in enumerate(prompts)]
    batch.add(requests)
    out = {i: [] for i in range(len(prompts))}
    while len(batch):
        for event in batch.step():
            out[event.request_id] += event.tokens
    return [out[i] for i in range(len(prompts))], batch.stats


@pytest.mark.parametrize("k", [1, 3, 6])
def test_alternates_keep_greedy_output_exact(pair, target, k):
    draft = pair[1]
    plain = [_decode(target, ModelDrafter(draft, target.vocab_size), [p], _Always(0))[0][0] for p in PROMPTS]
    taken = 0
    for prompt, expected in zip(PROMPTS, plain):
        got, stats = _decode(target, ModelDrafter(draft, target.vocab_size), [prompt], _Always(k))
        assert got[0] == expected, f"prompt {prompt}"
        taken += stats.alternates_accepted
    batch, stats = _decode(target, ModelDrafter(draft, target.vocab_size), PROMPTS, _Always(k))
    assert batch == plain
    assert taken > 0 and stats.alternates_accepted > 0  # the alternates were really used, not just carried


class _PricedLikeAPair(AdaptiveDraftLen):
    """The adaptive policy fed the costs of a real pair (a draft token 0.1 of a step, a verify row 0.02),
    not the tiny models' own: their draft costs as much as their target, so speculation would not pay."""

    ROW = 0.002  # seconds a verify row adds to a 0.1 s pass

    def observe(self, step):
        rows = step.batch_size * (step.width + step.extra_rows)
        super().observe(replace(step, draft_seconds=0.01 * (step.width - 1), target_seconds=0.1 + self.ROW * rows))


def test_adaptive_policy_places_alternates_and_stays_exact(pair):
    """With draft_len="tree" on a tree-capable target, alternates are placed where they pay, and taken."""
    target, _, hf = pair
    draft = NativeCausalLM.from_hf(perturbed_copy(hf, scale=0.1))  # right often enough to be worth drafting
    plain = [_decode(target, ModelDrafter(draft, target.vocab_size), [p], _Always(0), 40)[0][0] for p in PROMPTS]
    got, stats = _decode(target, ModelDrafter(draft, target.vocab_size), PROMPTS, _PricedLikeAPair(alternates=True), 40)
    assert got == plain
    assert stats.alternates_drafted > 0 and stats.alternates_accepted > 0


def test_branch_rule_places_alternates_by_worth_while_they_pay_for_their_row():
    """An alternate is worth P(chain reaches it) * b(its confidence) tokens; the best go first, and each
    must beat the price of the row it adds where it lands (rows get dearer as the pass widens)."""
    policy = AdaptiveDraftLen()
    prices = [float("inf"), 0.1, 0.1, 0.1, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3]  # by the pass width a row joins
    stop = ConfidenceStop(policy.calibration, [0.0] * 4, policy.alternate_calibration, prices)
    for position, confidence in enumerate([0.999, 0.55, 0.999, 0.999]):
        assert stop(position, torch.tensor([confidence]))[0]
    # reach: ~1 at positions 0-1, ~a(0.55) ~ 0.74 at 2-3; b(conf) starts at its bin's middle
    second = torch.tensor([[0.25, 0.35, 0.35, 0.05]])
    # worth ~0.25, 0.35, 0.26, 0.04: a pass of 5 rows takes 0.35 at width 5 (price 0.2), then 0.26 < 0.3 stops
    assert stop.branch(second, torch.tensor([4])).tolist() == [[False, True, False, False]]
    # a chain of 2: the pass is 3 wide, and both alternates within it pay (0.35, then 0.25 at 0.1)
    assert stop.branch(second, torch.tensor([2])).tolist() == [[True, True, False, False]]


def test_alternate_calibration_learns_from_taken_alternates():
    policy = AdaptiveDraftLen()
    before = float(policy.alternate_calibration(torch.tensor([0.35])))
    present = torch.tensor([[True, False]])
    for _ in range(30):  # the chain breaks at position 0 and the alternate (confidence 0.35) is the target's token
        policy.observe(StepRecord(1, 2, 3, torch.tensor([2]), torch.tensor([0]), 0.01, 0.1, torch.tensor([[0.9, 0.9]]), extra_rows=1,
                                  alternates=AlternateOutcome(present, torch.tensor([[0.35, 0.0]]), present, present)))
    assert before < 0.4 < float(policy.alternate_calibration(torch.tensor([0.35])))
