"""Speculative cascades (Narasimhan et al., "Faster Cascades via Speculative Decoding", ICLR 2025): a lossy
rule, only for rows that ask for it (`SamplingParams.cascade`).

A cascade answers with the small model where a deferral rule says it is good enough there, and defers to
the large one elsewhere. Done speculatively, draft position i is verified against the mixture

    pi_i = (1 - r_i) q_i + r_i p_i,        r_i = delta(q_i, p_i) in {0, 1}    (the paper's target, Sec. 4)

by speculative sampling's rule with pi in place of p: keep x_i with probability min(1, pi_i(x_i) / q_i(x_i)),
after a rejection draw the target's token from norm(max(0, pi_i - q_i)). Where the rule trusts the draft
(r = 0) pi = q and the token always stands; where it defers (r = 1) pi = p and this is exact speculative
sampling there. The deferral rule (`sampling.Cascade`) reads the top probabilities only:

    chow: trust the draft where max q > 1 - alpha        diff: where max q > max p - alpha

Sampled rows judge the distributions they sample from (warped: temperature, top-k, top-p). Greedy rows
decode argmax pi: a draft token stands where the rule trusts the draft, else only if it is the target's
argmax, and the target's token after the kept prefix is its argmax; their max q and max p are those of the
plain softmax (temperature 1: the draft's `confidence`), as the warped ones are one-hot.

The rule never trusts a token the target rules out (probability zero after its logit processing and
warping: a grammar's mask, a logit_bias ban, min_tokens, top-k/top-p), so constraints hold as in plain
decoding. The token after a fully kept draft comes from p: the draft has no distribution there to mix, so
that position defers. A draft without the draft's probabilities (n-gram or cross-tokenizer: `Draft.probs` None
on a sampled row, `Draft.confidence` None on a greedy one) is no model to cascade to: all its positions
defer. At the rule's exact end (chow alpha 0, diff alpha -1) every position defers and the output is the
target's; elsewhere it is not (tests/exactness/test_cascade.py measures by how much, and
bench/cascade_tradeoff.py what it buys). Rows that did not ask are verified by the exact rule they would
get anyway. Knows nothing about models: it reads the draft and the target's logits.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, Verdict
from verispec.sampling import Cascade, SamplingParams, argmax, sample, warp
from verispec.verifiers.base import Verifier, accepted_prefix, drafted_mask, residual


def trusts_draft(cascade: Cascade, max_q: torch.Tensor, max_p: torch.Tensor) -> torch.Tensor:
    """The deferral rule, inverted: [k] bool, True where the cascade keeps the draft's distribution
    (r = 0), from the draft's and the target's top probabilities max_q, max_p [k]."""
    if cascade.rule == "chow":
        return max_q > 1.0 - cascade.alpha
    return max_q > max_p - cascade.alpha


class CascadeVerifier:
    lossless = False
    takes_alternates = False

    def __init__(self, exact: Verifier | None):
        self.exact = exact  # the lossless (or typical) verifier for the rows that did not ask for a cascade (None: no such rows)

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
               positions: list[int] | None = None) -> Verdict:
        if draft.has_alternates:
            raise ValueError("speculative cascades check chains: a draft for their rows carries no alternates")
        cascading = torch.tensor([s.cascade is not None for s in sampling])
        verdict = Verdict(num_accepted=torch.zeros(len(sampling), dtype=torch.long),
                          next_tokens=torch.zeros(len(sampling), dtype=torch.long))
        if not bool(cascading.all()):  # the others, by their own rule, on their own rows
            rows = (~cascading).nonzero().squeeze(1)
            exact = self.exact.verify(draft.rows(rows), target_logits[rows], [sampling[b] for b in rows.tolist()],
                                      [generators[b] for b in rows.tolist()],
                                      None if positions is None else [positions[b] for b in rows.tolist()])
            verdict.num_accepted[rows], verdict.next_tokens[rows] = exact.num_accepted, exact.next_tokens
        drafted = drafted_mask(draft)
        for b in cascading.nonzero().squeeze(1).tolist():
            row = _greedy_row if sampling[b].greedy else _sampled_row
            verdict.num_accepted[b], verdict.next_tokens[b] = row(draft, b, target_logits[b].cpu(), drafted[b], sampling[b], generators[b])
        return verdict


def _greedy_row(draft: Draft, b: int, logits: torch.Tensor, drafted: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[int, int]:
    """Row b of a greedy cascade: (tokens kept, the target's token after them). logits [k + 1, V]."""
    k = draft.draft_len
    best = argmax(logits)  # [k + 1]
    if draft.confidence is None:
        trusted = torch.zeros(k, dtype=torch.bool)
    else:
        allowed = logits[:k].gather(1, draft.tokens[b, :, None]).squeeze(1) > float("-inf")  # not masked by the target
        trusted = trusts_draft(params.cascade, draft.confidence[b], logits[:k].float().softmax(-1).max(-1).values) & allowed
    accept = (trusted | (draft.tokens[b] == best[:k])) & drafted
    kept = int(accepted_prefix(accept[None])[0])
    return kept, int(best[kept])


def _sampled_row(draft: Draft, b: int, logits: torch.Tensor, drafted: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator) -> tuple[int, int]:
    """Row b of a sampled cascade: (tokens kept, the target's token after them). logits [k + 1, V]."""
    k = draft.draft_len
    p = warp(logits, params)  # [k + 1, V]
    if draft.probs is None:  # a deterministic draft: a point mass q, never trusted
        q = torch.nn.functional.one_hot(draft.tokens[b], p.shape[-1]).float()
        trusted = torch.zeros(k, dtype=torch.bool)
    else:
        q = draft.probs[b]  # [k, V]
        allowed = p[:k].gather(1, draft.tokens[b, :, None]).squeeze(1) > 0  # in the target's support
        trusted = trusts_draft(params.cascade, q.max(-1).values, p[:k].max(-1).values) & allowed
    defer = (~trusted).float()[:, None]
    pi = (1.0 - defer) * q + defer * p[:k]  # [k, V]
    tokens = draft.tokens[b, :, None]
    uniforms = torch.rand(k, generator=generator) if k else torch.zeros(0)
    # u < pi/q, written as u * q < pi so that q = 0 never divides (such a token is never drafted).
    accept = (uniforms * q.gather(1, tokens).squeeze(1) < pi.gather(1, tokens).squeeze(1)) & drafted
    kept = int(accepted_prefix(accept[None])[0])
    if kept < int(drafted.sum()):  # rejected at `kept` (a deferred position): recover from pi's residual
        return kept, int(sample(residual(1.0, pi[kept], q[kept]), generator))
    return kept, int(sample(p[kept], generator))  # every drafted token kept: the bonus token, from the target
