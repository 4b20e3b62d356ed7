"""The contract of an acceptance rule: (draft, target logits) -> verdict."""

from __future__ import annotations

from typing import Protocol

import torch

from verispec.drafters.base import Draft, Verdict
from verispec.sampling import SamplingParams, warp_rows


class Verifier(Protocol):
    lossless: bool  # True: output follows the target's own distribution exactly
    takes_alternates: bool  # True: judges a draft's alternates (a token-tree pass), not only its chain

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
               positions: list[int] | None = None) -> Verdict:
        """sampling, generators: per row. target_logits: [batch, k + 1, vocab]; position i scores the token after draft position i - 1
        (position 0 follows the last accepted token), so position k gives the bonus token. positions: per row,
        the sequence length before the draft (the index draft token 0 would take), for rules whose
        randomness is keyed by position (`CoupledVerifier`); others ignore it."""
        ...


def drafted_mask(draft: Draft) -> torch.Tensor:
    """[batch, k] bool: which draft positions hold a real proposal."""
    positions = torch.arange(draft.draft_len, device=draft.tokens.device)
    return positions[None, :] < draft.num_drafted[:, None]


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """[batch, k] bool per-position acceptance -> [batch] long length of the all-accepted prefix."""
    return accept.long().cumprod(1).sum(1)


def chain_distributions(draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(p [batch, width, vocab] the target's warped distributions over the pass: k + 1 chain columns, then a
    tree pass's alternates; q [batch, k, vocab] the draft's: its own probabilities, or one-hot on its tokens
    for a draft without them, e.g. n-gram)."""
    if draft.has_alternates and draft.alternate_probs is None:
        raise ValueError("a sampled draft's alternates need the distributions they were drawn from (alternate_probs)")
    p = warp_rows(target_logits.cpu(), sampling)
    q = draft.probs if draft.probs is not None else torch.nn.functional.one_hot(draft.tokens, p.shape[-1]).float()
    return p, q


def residual(weight: float, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where the target's token comes from after a rejection: normalized max(0, weight * p - q) [V], in
    p's dtype (weight 1 for token-by-token speculative sampling, a block's w_i for block verification).
    Zero mass means the rejection had probability zero; p keeps the draw exact against rounding."""
    # in place on one copy: on a CPU each new vocabulary-wide tensor costs more than the arithmetic (fresh pages)
    mass = p.to(torch.promote_types(p.dtype, q.dtype), copy=True).mul_(weight).sub_(q).clamp_(min=0)
    total = mass.sum()
    return mass.div_(total) if total > 0 else p
