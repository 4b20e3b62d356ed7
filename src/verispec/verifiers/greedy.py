"""Greedy verification: accept draft tokens while they equal the target's argmax.

The result is token-for-token the target's own greedy decoding, whatever the drafter proposed.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, Verdict
from verispec.sampling import SamplingParams
from verispec.verifiers.base import accepted_prefix, drafted_mask


class GreedyVerifier:
    lossless = True
    takes_alternates = True

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
               positions: list[int] | None = None) -> Verdict:
        target_tokens = target_logits.argmax(-1).cpu()  # [batch, k + 1 (+ alternates)]
        k = draft.draft_len
        accept = (draft.tokens == target_tokens[:, :k]) & drafted_mask(draft)
        num_accepted = accepted_prefix(accept)
        next_tokens = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
        if not draft.has_alternates:
            return Verdict(num_accepted=num_accepted, next_tokens=next_tokens)
        # Where the chain was rejected, the target's token may be that position's alternate: accept it,
        # and take the target's token after it from the alternate's own row of the pass.
        token, column = draft.alternate_at(num_accepted)
        alternate = (num_accepted < draft.num_drafted) & (token == next_tokens)
        after = target_tokens.gather(1, column.clamp(min=0)[:, None]).squeeze(1)
        return Verdict(num_accepted=num_accepted, next_tokens=torch.where(alternate, after, next_tokens), alternate=alternate)
