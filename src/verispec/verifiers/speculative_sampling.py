"""Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): lossless for any draft.

Draft token x_i drawn from q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)). At the
first rejection the target's token is drawn from the residual norm(max(0, p_i - q_i)); when every
drafted token is accepted, a bonus token is drawn from p_{k+1}. Each emitted token is then
distributed exactly as p given its prefix. p is the *warped* target distribution (temperature,
top-k, top-p), the same one plain sampling draws from. A draft without probabilities (n-gram) is a
one-hot q: accept with probability p_i(x_i), else resample from p_i with x_i removed. An alternate
beside the rejected position gets its own test against the residual first (`verifiers.tree`).
With greedy settings p is one-hot at the argmax and the rule reduces exactly to greedy
verification, so one batch may mix greedy and sampled rows.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, Verdict
from verispec.sampling import SamplingParams
from verispec.verifiers.base import accepted_prefix, chain_distributions, drafted_mask, residual
from verispec.verifiers.tree import target_token


class SpeculativeSamplingVerifier:
    lossless = True
    takes_alternates = True

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
               positions: list[int] | None = None) -> Verdict:
        p, q = chain_distributions(draft, target_logits, sampling)  # [batch, k + 1, vocab], [batch, k, vocab]
        batch, k = draft.tokens.shape
        p_draft = p[:, :k].gather(2, draft.tokens[..., None]).squeeze(2)  # [batch, k]
        q_draft = q.gather(2, draft.tokens[..., None]).squeeze(2)
        uniforms = torch.stack([torch.rand(k, generator=g) for g in generators]) if k else torch.zeros(batch, 0)
        # u < p/q, written as u * q < p so that q = 0 never divides (such a token is never drafted).
        accept = (uniforms * q_draft < p_draft) & drafted_mask(draft)
        num_accepted = accepted_prefix(accept)

        next_tokens = torch.empty(batch, dtype=torch.long)
        branch = []
        for b in range(batch):
            j = int(num_accepted[b])
            # Rejected at j: recover from the residual there; every drafted token accepted: the bonus token
            # from p. Either way through whatever alternates hang at j (`verifiers.tree`).
            dist = residual(1.0, p[b, j], q[b, j]) if j < int(draft.num_drafted[b]) else p[b, j]
            token, path = target_token(draft, p, b, j, dist, generators[b])
            next_tokens[b] = token
            branch.append(path)
        return Verdict(num_accepted=num_accepted, next_tokens=next_tokens, branch=branch if draft.has_alternates else None)
