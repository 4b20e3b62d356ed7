"""Coupled verification: speculative sampling whose output does not depend on the draft.

Each position's token is an exponential race over the target's warped p with noise keyed by (seed,
position, token) (`sampling.coupled_choice`; the Gumbel-max trick). The draft drew its own tokens from q
with the same noise, so where q resembles p it usually drew the same token. The verifier runs the race
on p at each drafted position, accepts the draft's tokens while the two agree, and emits the target's
winner at the first disagreement (or at the position after a fully accepted draft). Every emitted token
is the one plain sampling with that seed picks at that position, so the output is the same for any
drafter, draft length or batch, and is distributed exactly as p. The price: agreement of the two races
is at least (1 - TV) / (1 + TV) where speculative sampling accepts with 1 - TV (Daliri et al. 2024).
Rows that did not ask for coupling are verified by speculative sampling, greedy rows by argmax.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, Verdict
from verispec.sampling import SamplingParams, coupled_choice, warp
from verispec.verifiers.speculative_sampling import SpeculativeSamplingVerifier


class CoupledVerifier:
    lossless = True
    takes_alternates = False

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
               positions: list[int] | None = None) -> Verdict:
        if draft.has_alternates:
            raise ValueError("coupled verification verifies chains: a draft for coupled rows carries no alternates")
        if positions is None:
            raise ValueError("coupled verification needs each row's position (the sequence length before the draft)")
        uncoupled = [not s.coupled and not s.greedy for s in sampling]
        if any(uncoupled):  # they take speculative sampling (greedy rows with them); coupled rows are redone below
            verdict = SpeculativeSamplingVerifier().verify(draft, target_logits, sampling, generators)
            num_accepted, next_tokens = verdict.num_accepted.clone(), verdict.next_tokens.clone()
            rows = [b for b, s in enumerate(sampling) if s.coupled and not s.greedy]
        else:  # every row races (a greedy row's one-hot p makes its winner the argmax)
            num_accepted = torch.zeros(len(sampling), dtype=torch.long)
            next_tokens = torch.zeros(len(sampling), dtype=torch.long)
            rows = range(len(sampling))
        logits = target_logits.cpu()
        for b in rows:
            if not sampling[b].greedy and sampling[b].seed is None:
                raise ValueError("a coupled row needs a seed (the engine draws one for requests without)")
            seed = sampling[b].seed or 0
            drafted = int(draft.num_drafted[b])
            for j in range(drafted + 1):
                token = coupled_choice(warp(logits[b, j], sampling[b]), seed, positions[b] + j)
                if j == drafted or token != int(draft.tokens[b, j]):
                    num_accepted[b], next_tokens[b] = j, token
                    break
        return Verdict(num_accepted=num_accepted, next_tokens=next_tokens)
