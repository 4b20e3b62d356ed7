"""Block verification (Sun et al., ICLR 2025): speculative sampling that judges the draft as a whole.

Token-by-token verification stops at the first draft token it rejects, even when the tokens after it
would have made up for it. Block verification carries a weight w_i through the draft instead,

    w_0 = 1,   w_i = min(1, w_{i-1} * p_i(x_i) / q_i(x_i)),

where p_i and q_i are the target's and the draft's distributions for draft token i given the tokens
before it. A prefix of length i is where the row may stop with chance

    h_i = r_i / (r_i + 1 - w_i),   r_i = sum_x max(0, w_i p(x | x_1..x_i) - q(x | x_1..x_i))   (0 < i < g),
    h_g = w_g,

and the kept prefix is the longest i whose uniform draw falls below h_i (i = 0 when none does). The
target's own token then comes from the normalized residual max(0, w_i p - q) at that position, or from
p itself after a full draft (the bonus token). The emitted text is distributed exactly as the target's
(the paper proves it; `tests/test_block_verification.py` checks it by exact enumeration and by
sampling), and the expected number of accepted tokens is never below the token-by-token rule's: with
one draft token the two rules coincide. Greedy rows (one-hot p and q) get exactly the argmax chain.
Alternates at the stop position get their own tests against that residual (`verifiers.tree`).
Knows nothing about models: it reads the draft and the target's logits.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, Verdict
from verispec.sampling import SamplingParams, sample
from verispec.verifiers.base import chain_distributions, residual
from verispec.verifiers.tree import target_token


def block_weights(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's draft of g tokens: p [g + 1, V] the target's distributions (the last for the bonus
    token), q [g, V] the draft's, tokens [g]. -> (w [g + 1], h [g + 1]) in float64: the weights, and
    the chance of stopping at each prefix length (h_0 = 1: the empty prefix is always possible)."""
    g = tokens.shape[0]
    at = tokens[:, None]
    ratio = p[:g].gather(1, at).squeeze(1).double() / q.gather(1, at).squeeze(1).double()
    w = torch.ones(g + 1, dtype=torch.float64)
    for i in range(g):
        w[i + 1] = min(1.0, float(w[i] * ratio[i]))
    h = torch.ones(g + 1, dtype=torch.float64)
    if g:
        # in place on one float64 copy of p's rows: each new [g, V] float64 tensor cost ~5 ms on a CPU (fresh
        # pages), ten times the arithmetic; the same operations, so the same numbers
        mass = p[1:g].to(torch.float64, copy=True).mul_(w[1:g, None]).sub_(q[1:g]).clamp_(min=0).sum(1)
        denominator = mass + 1 - w[1:g]
        # A zero denominator (w_i = 1 and p = q there) is an event of weight zero: any value is exact;
        # 1 keeps a greedy row's correct prefix.
        h[1:g] = torch.where(denominator > 0, mass / denominator.clamp(min=1e-300), torch.ones_like(mass))
        h[g] = w[g]
    return w, h


class BlockVerifier:
    lossless = True
    takes_alternates = True

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
               positions: list[int] | None = None) -> Verdict:
        p, q = chain_distributions(draft, target_logits, sampling)  # [batch, k + 1, vocab], [batch, k, vocab]
        batch = draft.tokens.shape[0]
        num_accepted = torch.zeros(batch, dtype=torch.long)
        next_tokens = torch.empty(batch, dtype=torch.long)
        branch = []
        for b in range(batch):
            g = int(draft.num_drafted[b])
            tokens = draft.tokens[b, :g]
            w, h = block_weights(p[b, : g + 1], q[b, :g], tokens)
            draws = torch.rand(g, generator=generators[b], dtype=torch.float64)
            kept = next((i for i in range(g, 0, -1) if draws[i - 1] <= h[i]), 0)  # the longest prefix drawn
            num_accepted[b] = kept
            # The bonus token from p, or the token from the residual there; either way through whatever
            # alternates hang at that position (`verifiers.tree`).
            dist = p[b, g] if kept == g else residual(float(w[kept]), p[b, kept].double(), q[b, kept].double())
            next_tokens[b], path = target_token(draft, p, b, kept, dist, generators[b])
            branch.append(path)
        return Verdict(num_accepted=num_accepted, next_tokens=next_tokens, branch=branch if draft.has_alternates else None)
