"""Typical acceptance (Cai et al. 2024, Medusa, Sec. 3.3.1): a lossy rule, only for rows that ask for it.

Draft token x_i is accepted while the target finds it plausible enough:

    p_i(x_i) > min(eps, sqrt(eps) * exp(-H(p_i))),

where p_i is the target's warped distribution at draft position i (temperature, top-k, top-p, as plain
sampling uses) and H(p_i) its entropy in nats: where the target is unsure (high entropy) the bar is
lower, where it is sure the bar is eps. The kept prefix is the longest run of accepted tokens; the
target's own token after it is drawn from p at that position (the target's plain distribution, not
a residual), or from p after the last draft token when all were accepted. No uniform draw decides
acceptance and the draft's probabilities are not read, so a draft without them (n-gram) is judged the same way.

The output is *not* distributed as the target's: tokens the target gives little but non-negligible
probability are kept more often than it would sample them, rarely chosen ones less often. That is
the trade: more tokens per pass at temperature > 0, for text that is typical of the target rather than
a sample of it. Greedy rows stay exact (a one-hot p has zero entropy, so the bar is eps < 1 and only
the argmax passes), and rows that did not ask for it (`SamplingParams.typical_acceptance` = 0) are
verified by the exact rule they would get anyway. Knows nothing about models: it reads the draft and
the target's logits.
"""

from __future__ import annotations

import math

import torch

from verispec.drafters.base import Draft, Verdict
from verispec.sampling import SamplingParams, sample, warp
from verispec.verifiers.base import accepted_prefix, drafted_mask


def typical_bar(p: torch.Tensor, epsilon: float) -> torch.Tensor:
    """min(eps, sqrt(eps) * exp(-H(p))) over the last dimension of p [..., V]: what a draft token's
    probability under the target must exceed."""
    logs = torch.where(p > 0, p.log(), torch.zeros_like(p))
    entropy = -(p * logs).sum(-1)
    return torch.clamp(math.sqrt(epsilon) * torch.exp(-entropy), max=epsilon)


class TypicalVerifier:
    lossless = False
    takes_alternates = False

    def __init__(self, exact):
        self.exact = exact  # the lossless verifier for the rows that did not ask for typical acceptance (None: no such rows)

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
               positions: list[int] | None = None) -> Verdict:
        if draft.has_alternates:
            raise ValueError("typical acceptance checks chains: a draft for its rows carries no alternates")
        typical = torch.tensor([s.lossy for s in sampling])
        verdict = Verdict(num_accepted=torch.zeros(len(sampling), dtype=torch.long),
                          next_tokens=torch.zeros(len(sampling), dtype=torch.long))
        if not bool(typical.all()):  # the others, by the exact rule, on their own rows
            rows = (~typical).nonzero().squeeze(1)
            exact = self.exact.verify(draft.rows(rows), target_logits[rows], [sampling[b] for b in rows.tolist()],
                                      [generators[b] for b in rows.tolist()],
                                      None if positions is None else [positions[b] for b in rows.tolist()])
            verdict.num_accepted[rows], verdict.next_tokens[rows] = exact.num_accepted, exact.next_tokens
        k = draft.draft_len
        for b in typical.nonzero().squeeze(1).tolist():
            p = warp(target_logits[b].cpu(), sampling[b])  # [k + 1, vocab]
            p_draft = p[:k].gather(1, draft.tokens[b, :, None]).squeeze(1)
            accept = (p_draft > typical_bar(p[:k], sampling[b].typical_acceptance)) & drafted_mask(draft)[b]
            kept = int(accepted_prefix(accept[None])[0])
            verdict.num_accepted[b], verdict.next_tokens[b] = kept, sample(p[kept], generators[b])
        return verdict
