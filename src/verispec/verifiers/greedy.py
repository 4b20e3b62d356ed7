"""Greedy verification: accept draft tokens while they equal the target's argmax.

The result is token-for-token the target's own greedy decoding, whatever the drafter proposed.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, Verdict
from verispec.sampling import SamplingParams, argmax
from verispec.verifiers.base import accepted_prefix, drafted_mask


class GreedyVerifier:
    lossless = True
    takes_alternates = True

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
               positions: list[int] | None = None) -> Verdict:
        target_tokens = argmax(target_logits).cpu()  # [batch, k + 1 (+ alternates)]
        k = draft.draft_len
        accept = (draft.tokens == target_tokens[:, :k]) & drafted_mask(draft)
        num_accepted = accepted_prefix(accept)
        next_tokens = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
        if not draft.has_alternates:
            return Verdict(num_accepted=num_accepted, next_tokens=next_tokens)
        # Where the chain broke off (or ended), the target's token may be an alternate hanging there: take it,
        # and the target's token after it from the alternate's own column of the pass, down the tree.
        tree = draft.tree
        branch = []
        for b in range(len(next_tokens)):
            column, path = int(num_accepted[b]), []
            while True:
                wanted = int(target_tokens[b, column])
                child = next((c for c in tree.children(b, column) if tree.token(b, c) == wanted), None)
                if child is None:
                    break
                column = child
                path.append(child)
            next_tokens[b] = target_tokens[b, column]
            branch.append(path)
        return Verdict(num_accepted=num_accepted, next_tokens=next_tokens, branch=branch)
