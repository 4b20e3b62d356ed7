"""A second candidate per position for sampled drafts: the alternate beside the position where the chain stopped.

An exact chain rule (speculative sampling, block verification) ends a step by drawing the target's token
at the stop position from some distribution R: the residual there, or p itself after a full draft. When
the draft put an alternate y beside that position, drawn from q' (its q with the chain's token taken out:
sampling without replacement, as in Recursive Speculative Decoding, Jeon et al. 2024; SpecInfer's
multi-step speculative sampling draws with replacement), y gets a speculative-sampling test of its own
against R:

    accept y with probability min(1, R(y) / q'(y)), else draw from norm(max(0, R - q')).

By the speculative sampling lemma with q' as the proposal, the token this emits is distributed exactly
as R, whatever the chain's token was, so the chain rule stays lossless. Several alternates at one place are tried in turn, each against what the test of the one before
left (recursive rejection over siblings, as in SpecInfer's multi-candidate verification; a
deterministic candidate, like an EAGLE-2 tree's top-k, has q' one-hot on itself). An accepted y earns
the token after it: the target's own draw from its distribution in y's column of the tree pass, where
y's own alternates (a deeper tree) get the same test in turn. A greedy row's alternate is its draft's
second choice with q' one-hot on it: it is kept exactly when it is the target's argmax, as in
`GreedyVerifier`.
Knows nothing about models or drafting: it reads distributions.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft
from verispec.sampling import sample


def alternate_test(dist: torch.Tensor, alternate_q: torch.Tensor, token: int) -> tuple[float, torch.Tensor]:
    """dist [V] the distribution the target's token must follow (R), alternate_q [V] the q' the alternate
    `token` was drawn from. -> (the chance the alternate is accepted, the distribution [V] to draw from
    when it is not: norm(max(0, R - q')), or R itself where that has no mass, an event of chance zero)."""
    dist = dist.double()
    alternate_q = alternate_q.to(dist)
    chance = min(1.0, float(dist[token] / alternate_q[token])) if float(alternate_q[token]) > 0 else 0.0
    rest = (dist - alternate_q).clamp_(min=0)
    total = rest.sum()
    return chance, (rest.div_(total) if total > 0 else dist)


def target_token(draft: Draft, p: torch.Tensor, row: int, position: int, dist: torch.Tensor,
                 generator: torch.Generator) -> tuple[int, list[int]]:
    """The target's token for `row` at chain `position`, where it must follow `dist` [V], with whatever of the
    token tree hangs there; p [batch, width, V] the target's warped distributions over the whole pass
    (alternate columns included).

    The alternates hanging at `position` are tried in the draft's order, each against what the ones before it
    left (`alternate_test`: recursive rejection, SpecInfer's multi-candidate verification drawing without
    replacement); an accepted one earns a try of its own children against the target's distribution in its
    column, and so on down the tree. Returns (the token that ends the step, the columns of the alternates
    accepted on the way, in order: the token follows the last of them)."""
    if draft.alternates is None:
        return sample(dist, generator), []
    tree = draft.tree
    column, path = position, []  # chain position i's token follows column i of the pass
    while True:
        for child in tree.children(row, column):
            source = int(tree.source[row, child])
            chance, otherwise = alternate_test(dist, draft.alternate_probs[row, source], tree.token(row, child))
            if float(torch.rand((1,), generator=generator, dtype=torch.float64)) < chance:
                column, dist = child, p[row, child]
                path.append(child)
                break
            dist = otherwise
        else:
            return sample(dist, generator), path
