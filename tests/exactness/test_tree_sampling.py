"""Sampled token trees: an alternate beside the stop position, judged against the distribution the target's
token would have come from (`verifiers.tree`), must keep both exact rules exact.

First by exact enumeration: every draft block, every stopping point and every alternate, weighed by its
probability, against the target's probability of each continuation; a plausible slip (judging the
alternate by the draft's full q instead of the q' it was drawn from) fails the same check. Then by
sampling, through the real verifiers (where accepting the alternate twice as often fails) and through
the engine on a tiny model, where the alternates are really taken.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import perturbed_copy, tiny_llama
from test_block_verification import Tree, block_stops, completer, drafted_blocks, target_probability
from test_trees import _Always
from test_sampling_exactness import P_THRESHOLD, VOCAB, chi2_pvalue, first_two_tokens_pvalues, reference_probs
from verispec.drafters import ModelDrafter
from verispec.drafters.base import Draft
from verispec.engine import DecodeBatch, Request
from verispec.models.native import NativeCausalLM
from verispec.sampling import SamplingParams, make_generators, sample, warp
from verispec.verifiers import BlockVerifier, SpeculativeSamplingVerifier
from verispec.verifiers import tree as tree_rule
from verispec.verifiers.base import residual
from verispec.verifiers.tree import alternate_test


def without(q: torch.Tensor, token: int) -> torch.Tensor | None:
    """q' for an alternate beside `token`: q with it taken out, renormalized (None: nothing left)."""
    rest = q.clone()
    rest[token] = 0.0
    return rest / rest.sum() if float(rest.sum()) > 0 else None


def token_stops(p, q, block):
    """(kept, its chance given the block, the distribution of the target's token there) for token-by-token
    speculative sampling (`block_stops` gives them for block verification)."""
    survive = 1.0
    for i, x in enumerate(block):
        accept = min(1.0, float(p[i, x] / q[i, x]))
        yield i, survive * (1 - accept), residual(1.0, p[i], q[i])
        survive *= accept
    yield len(block), survive, p[len(block)]


def emitted_with_alternates(tree: Tree, g: int, stops, test=alternate_test) -> tuple[dict, float]:
    """Exact probability of each first g + 1 tokens one step emits (completed by the target) when an
    alternate, drawn from q without the chain's token, stands beside every position; and the chance an
    alternate is taken."""
    out, taken = {}, 0.0
    complete = completer(tree, g + 1, out)

    for block, drafted, p, q in drafted_blocks(tree, g):
        for kept, chance, dist in stops(p, q, block):
            chance *= drafted
            alternate_q = without(q[kept], block[kept]) if kept < g else None
            if chance == 0:
                continue
            if alternate_q is None:  # a full draft (bonus token), or no mass left beside the chain's token
                for z, pz in enumerate(dist.tolist()):
                    complete(block[:kept] + (z,), chance * pz)
                continue
            for y, qy in enumerate(alternate_q.tolist()):
                if qy == 0:
                    continue
                accept, otherwise = test(dist, alternate_q, y)
                taken += chance * qy * accept
                complete(block[:kept] + (y,), chance * qy * accept)  # then the target's token after y
                for z, pz in enumerate(otherwise.tolist()):
                    complete(block[:kept] + (z,), chance * qy * (1 - accept) * pz)
    return out, taken


@pytest.mark.parametrize("stops", [block_stops, token_stops], ids=["block", "token"])
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("g", [1, 2, 3])
def test_alternates_keep_both_rules_exact_by_enumeration(stops, seed, g):
    tree = Tree(seed)
    out, _ = emitted_with_alternates(tree, g, stops)
    for tokens in itertools.product(range(tree.vocab), repeat=g + 1):
        assert out.get(tokens, 0.0) == pytest.approx(target_probability(tree, tokens), abs=1e-12)



def test_the_enumerated_alternates_are_taken():
    """The equality above is not vacuous: in these trees the alternates are often what the step emits."""
    for stops in (block_stops, token_stops):
        taken = [emitted_with_alternates(Tree(seed), 2, stops)[1] for seed in range(5)]
        assert sum(t > 0.01 for t in taken) >= 2 and max(taken) > 0.05, taken


def test_enumeration_catches_judging_the_alternate_by_the_full_q():
    """Negative control: the alternate judged by min(1, R(y) / q(y)) with the q the chain's token came from."""
    worst = 0.0
    for seed in range(5):
        tree = Tree(seed)
        full_q = {}

        def slipped(dist, alternate_q, y):
            chance, _ = alternate_test(dist, alternate_q, y)
            q = full_q["q"]
            wrong = min(1.0, float(dist[y] / q[y])) if q[y] > 0 else 0.0
            rest = (dist - q).clamp(min=0)
            return wrong, (rest / rest.sum() if rest.sum() > 0 else dist)

        def stops(p, q, block):
            for kept, chance, dist in block_stops(p, q, block):
                full_q["q"] = q[kept] if kept < len(block) else None
                yield kept, chance, dist

        out, _ = emitted_with_alternates(tree, 2, stops, test=slipped)
        worst = max(worst, max(abs(out.get(t, 0.0) - target_probability(tree, t)) for t in itertools.product(range(3), repeat=3)))
    assert worst > 1e-3


N = 30000


def sampled_tree_drafts(q: torch.Tensor, params: SamplingParams, seed: int = 0) -> tuple[Draft, list[torch.Generator]]:
    """N drafts of k tokens drawn from q [k, V], each with an alternate beside every position drawn from q
    without the chain's token, laid out as the engine's tree pass."""
    k = q.shape[0]
    gens = make_generators(SamplingParams(temperature=1.0, seed=seed), N)
    tokens = torch.zeros(N, k, dtype=torch.long)
    alternates = torch.full((N, k), -1, dtype=torch.long)
    alternate_probs = torch.zeros(N, k, VOCAB)
    for n, g in enumerate(gens):
        for i in range(k):
            tokens[n, i] = sample(q[i], g)
            rest = without(q[i], int(tokens[n, i]))
            if rest is not None:
                alternates[n, i], alternate_probs[n, i] = sample(rest, g), rest
    draft = Draft(tokens=tokens, num_drafted=torch.full((N,), k), probs=q.expand(N, k, VOCAB), alternates=alternates,
                  alternate_confidence=torch.zeros(N, k), alternate_probs=alternate_probs)
    return draft, gens


def tree_situation():
    """Target logits [3 chain columns + 2 alternate columns, V] and an unrelated draft's q [2, V]: chains are
    often rejected, and alternates often half-accepted, which a slip in their test would show."""
    g = torch.Generator().manual_seed(3)
    target_logits = torch.randn(3, VOCAB, generator=g) * 1.5
    q = warp(torch.randn(2, VOCAB, generator=g) * 1.5, SamplingParams(temperature=1.0))
    after_alternates = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    return torch.cat([target_logits, after_alternates]), q


def verify_tree_draws(verifier):
    params = SamplingParams(temperature=1.0)
    logits, q = tree_situation()
    draft, gens = sampled_tree_drafts(q, params)
    logits = logits.expand(N, 5, VOCAB)
    return draft, logits, verifier.verify(draft, logits, [params] * N, gens)


@pytest.mark.parametrize("verifier", [BlockVerifier(), SpeculativeSamplingVerifier()], ids=["block", "token"])
def test_verifiers_sample_the_target_with_alternates(verifier):
    """The real verifiers on N draws of one situation with an alternate beside every position: the first
    token follows p_0, and the token after an alternate taken at position 0 follows that alternate's column."""
    draft, logits, verdict = verify_tree_draws(verifier)
    first = np.array([verdict.emitted(draft, n)[0] for n in range(N)])
    assert chi2_pvalue(first, reference_probs(logits[0, 0].numpy(), 1.0)) > P_THRESHOLD
    at_zero = verdict.alternate & (verdict.num_accepted == 0)
    assert int(at_zero.sum()) > 1000  # alternates really taken
    column = torch.tensor([verdict.branch[n][0] for n in at_zero.nonzero().squeeze(1).tolist()])
    after = verdict.next_tokens[at_zero]
    for c in column.unique().tolist():  # rows lay out their alternates left to right: column 3 or 4
        p_after = reference_probs(logits[0, c].numpy(), 1.0)
        assert chi2_pvalue(after[column == c].numpy(), p_after) > P_THRESHOLD


def test_verifier_check_catches_an_alternate_accepted_too_often(monkeypatch):
    """Negative control: the alternate accepted with twice its chance (capped at 1) skews the first token."""
    honest = tree_rule.alternate_test
    monkeypatch.setattr(tree_rule, "alternate_test", lambda dist, q, y: (min(1.0, 2 * honest(dist, q, y)[0]), honest(dist, q, y)[1]))
    draft, logits, verdict = verify_tree_draws(BlockVerifier())
    first = np.array([verdict.emitted(draft, n)[0] for n in range(N)])
    assert chi2_pvalue(first, reference_probs(logits[0, 0].numpy(), 1.0)) < 1e-10


@pytest.mark.parametrize("blockwise", [True, False], ids=["block", "token"])
def test_engine_samples_the_target_with_alternates(blockwise):
    """A native tiny model, a draft token with an alternate beside it, 2000 seeded rows in batches of 4 (a
    tree pass stays within the rows the kernels compute exactly): the first two tokens follow the target's
    p(t1) p(t2 | t1), and alternates were taken (each then gives both tokens: itself, and the token after it)."""
    params = SamplingParams(temperature=0.8, seed=11, blockwise=blockwise)
    hf = tiny_llama(seed=0)
    target = NativeCausalLM.from_hf(hf)
    draft = NativeCausalLM.from_hf(perturbed_copy(hf, scale=0.3))
    prompt = [1, 5, 6, 7, 8, 5, 6]
    out, taken = {}, 0
    for first_row in range(0, 2000, 4):
        batch = DecodeBatch(target, ModelDrafter(draft, target.vocab_size), _Always(3))
        batch.add([Request(prompt=prompt, sampling=replace(params, seed=params.seed + b), max_new_tokens=2, id=b)
                   for b in range(first_row, first_row + 4)])
        while len(batch):
            for event in batch.step():
                out.setdefault(event.request_id, []).extend(event.tokens)
        taken += batch.stats.alternates_accepted
    first, second = first_two_tokens_pvalues(hf, prompt, params, [out[b] for b in range(2000)])
    assert first > P_THRESHOLD and second > P_THRESHOLD
    assert taken > 100


# --- deeper trees: several siblings at a place, and alternates that follow alternates ------------------

N_DEEP = 12000  # draws for the deep tree: enough for every branch's conditional check, a third of the time


def deep_tree_drafts(q: torch.Tensor, seed: int = 0) -> tuple[Draft, list[torch.Generator]]:
    """N_DEEP drafts laid out as an EAGLE-2 tree of a sampled row: the chain token x ~ q[0]; two siblings beside it
    drawn from q[0] without replacement (y1 without x, y2 without x and y1); after each sibling one child,
    z1 ~ q[1] after y1 and z2 ~ q[2] after y2. Pass columns: [last, x, y1, y2, z1, z2]."""
    gens = make_generators(SamplingParams(temperature=1.0, seed=seed), N_DEEP)
    tokens = torch.zeros(N_DEEP, 1, dtype=torch.long)
    alternates = torch.full((N_DEEP, 4), -1, dtype=torch.long)
    alternate_probs = torch.zeros(N_DEEP, 4, VOCAB)
    for n, g in enumerate(gens):
        x = sample(q[0], g)
        first = without(q[0], x)
        y1 = sample(first, g)
        second = without(first, y1)
        tokens[n, 0], alternates[n, 0], alternate_probs[n, 0] = x, y1, first
        alternates[n, 1], alternate_probs[n, 1] = sample(second, g), second
        for j, child_q in ((2, q[1]), (3, q[2])):
            alternates[n, j], alternate_probs[n, j] = sample(child_q, g), child_q
    parents = torch.tensor([[0, 0, -1, -2]]).expand(N_DEEP, 4)  # y1, y2 beside position 0; z1 after y1, z2 after y2
    draft = Draft(tokens=tokens, num_drafted=torch.ones(N_DEEP, dtype=torch.long), probs=q[:1].expand(N_DEEP, 1, VOCAB),
                  alternates=alternates, alternate_confidence=torch.zeros(N_DEEP, 4), alternate_probs=alternate_probs,
                  alternate_parents=parents)
    return draft, gens


def verify_deep_tree(verifier):
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, VOCAB, generator=g) * 1.5).expand(N_DEEP, 6, VOCAB)
    q = warp(torch.randn(3, VOCAB, generator=g) * 1.5, SamplingParams(temperature=1.0))
    draft, gens = deep_tree_drafts(q)
    params = SamplingParams(temperature=1.0)
    return draft, logits, verifier.verify(draft, logits, [params] * N_DEEP, gens)


def test_deep_tree_layout_follows_the_parents():
    draft, _ = deep_tree_drafts(warp(torch.randn(3, VOCAB), SamplingParams(temperature=1.0)))
    tree = draft.rows(torch.tensor([0])).tree
    assert tree.parent.tolist() == [[-1, 0, 0, 0, 2, 3]] and tree.source.tolist() == [[-1, -1, 0, 1, 2, 3]]
    assert tree.children(0, 0) == [2, 3] and tree.children(0, 2) == [4] and tree.path(0, 5) == [3, 5]
    assert tree.mask[0, 4].tolist() == [True, False, True, False, True, False]  # z1 sees the last token, y1, itself


@pytest.mark.parametrize("verifier", [BlockVerifier(), SpeculativeSamplingVerifier()], ids=["block", "token"])
def test_verifiers_sample_the_target_down_a_deep_tree(verifier):
    """N_DEEP draws through the real verifiers: the first token follows p at the last token's column; after a
    sibling taken, the next token follows p in that sibling's column, and after its child, in the child's."""
    draft, logits, verdict = verify_deep_tree(verifier)
    emitted = [verdict.emitted(draft, n) for n in range(N_DEEP)]
    assert chi2_pvalue(np.array([e[0] for e in emitted]), reference_probs(logits[0, 0].numpy(), 1.0)) > P_THRESHOLD
    for path_start in ([2], [3], [2, 4], [3, 5]):
        rows = [n for n in range(N_DEEP) if verdict.branch[n][: len(path_start)] == path_start]
        assert len(rows) > 150, (path_start, len(rows))  # every branch of the tree is really taken
        after = np.array([emitted[n][len(path_start)] for n in rows])
        assert chi2_pvalue(after, reference_probs(logits[0, path_start[-1]].numpy(), 1.0)) > P_THRESHOLD


def test_deep_tree_check_catches_siblings_judged_against_the_same_distribution(monkeypatch):
    """Negative control: a rejected sibling's q' not taken out of the distribution the next one is judged by."""
    honest = tree_rule.alternate_test
    monkeypatch.setattr(tree_rule, "alternate_test", lambda dist, q, y: (honest(dist, q, y)[0], dist))
    draft, logits, verdict = verify_deep_tree(BlockVerifier())
    first = np.array([verdict.emitted(draft, n)[0] for n in range(N_DEEP)])
    assert chi2_pvalue(first, reference_probs(logits[0, 0].numpy(), 1.0)) < 1e-10
