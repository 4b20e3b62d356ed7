"""A second candidate per position for sampled drafts: the alternate beside the position where the chain stopped.

An exact chain rule (speculative sampling, block verification) ends a step by drawing the target's token
at the stop position from some distribution R: the residual there, or p itself after a full draft. When
the draft put an alternate y beside that position, drawn from q' (its q with the chain's token taken out:
sampling without replacement, as in Recursive Speculative Decoding, Jeon et al. 2024; SpecInfer's
multi-step speculative sampling draws with replacement), y gets a speculative-sampling test of its own
against R:

    accept y with probability min(1, R(y) / q'(y)), else draw from norm(max(0, R - q')).

By the speculative sampling lemma with q' as the proposal, the token this emits is distributed exactly
as R, whatever the chain's token was, so the chain rule stays lossless. An accepted y also earns the
token after it: the target's own draw from its distribution in y's column of the tree pass. A greedy
row's alternate is its draft's second choice with q' one-hot on it: it is kept exactly when it is the
target's argmax, as in `GreedyVerifier`.
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
    rest = (dist - alternate_q).clamp(min=0)
    total = rest.sum()
    return chance, (rest / total if total > 0 else dist)


def target_token(draft: Draft, p: torch.Tensor, row: int, position: int, dist: torch.Tensor,
                 generator: torch.Generator) -> tuple[int, bool]:
    """The target's token for `row` at chain `position`, where it must follow `dist` [V]; p [batch, width,
    V] the target's warped distributions over the whole pass (alternate columns included).

    Returns (the token that ends the step, whether the alternate beside `position` was accepted: the
    token then follows the alternate)."""
    if draft.alternates is None or position >= draft.draft_len or int(draft.alternates[row, position]) < 0:
        return sample(dist, generator), False
    _, _, columns = draft.tree
    alternate, column = int(draft.alternates[row, position]), int(columns[row, position])
    chance, otherwise = alternate_test(dist, draft.alternate_probs[row, position], alternate)
    if float(torch.rand((1,), generator=generator, dtype=torch.float64)) < chance:
        return sample(p[row, column], generator), True
    return sample(otherwise, generator), False
