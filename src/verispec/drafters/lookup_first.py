"""Suffix lookup where it is likely to be right, a trained head otherwise (Arctic Inference pairs suffix decoding
with its speculator alike).

A trained head drafts new text at a price (its passes cost a few % of a target step per token); suffix decoding
drafts text that repeats (a prompt being quoted or edited, code reusing its own names, an answer given before)
for next to nothing, and there often further than a head goes. Each step the lookup is asked first; its
draft is taken for the whole batch when the tokens it is expected to get accepted are at least what the
head's own drafting steps have been getting, and then the head skips the step (it reads the skipped
positions when it next drafts). Otherwise the head drafts and the lookup's proposal is dropped.

Both estimates are learned from the verdicts, decayed so a change of text shows within a few dozen steps:
the lookup's acceptance as a function of the frequency it reports for each token (`SuffixDrafter`'s
confidence: a continuation seen once says 0.5, and on a long match that is often right), and the head's
accepted tokens per drafting step. A lookup draft reports no confidence to the engine, so the policy's
calibration of the head's probabilities is not mixed with another drafter's frequencies.

A step is one kind for the whole batch (a lookup draft is deterministic, a head's may carry q), so either is
exact under every verifier.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict
from verispec.policy import Calibration
from verispec.sampling import SamplingParams


class _LookupAcceptance(Calibration):
    """a(conf): how often a lookup token of each reported frequency is accepted once its place is reached
    (`policy.Calibration` over coarser bins, shrunk toward a(conf) = conf); and what a draft is expected to get."""

    EDGES = torch.tensor([0.4, 0.6, 0.75, 0.9, 0.97])

    def __init__(self):
        super().__init__(decay=0.98, prior_weight=2.0, prior_power=1.0)

    def expected(self, draft: Draft) -> torch.Tensor:
        """[batch] the tokens each row's draft is expected to get accepted: sum_i prod_{j<=i} a(conf_j)."""
        width = draft.tokens.shape[1]
        if width == 0:
            return torch.zeros(draft.tokens.shape[0])
        drafted = torch.arange(width)[None, :] < draft.num_drafted[:, None]
        survive = torch.where(drafted, self(draft.confidence[:, :width]), torch.zeros(()))
        return survive.cumprod(1).sum(1)


class LookupFirstDrafter(Drafter):
    """`lookup` (a `SuffixDrafter`) where its draft is expected to do at least as well as `model`'s (a trained
    head's drafter), else `model`. The model must skip a step it is asked for no tokens, and read what it
    skipped when it next drafts (the heads' drafters do: `Drafter.catches_up`)."""

    reads_tenants = True
    reads_grammars = True  # the lookup's drafts end before a token the row's grammar forbids (a head's are not cut)

    def __init__(self, model: Drafter, lookup: Drafter, decay: float = 0.95, prior_accepted: float = 0.8,
                 prior_weight: float = 2.0):
        self.model, self.lookup = model, lookup
        self.target_taps, self.prompt_taps, self.catches_up = model.target_taps, model.prompt_taps, model.catches_up
        self.acceptance = _LookupAcceptance()
        # the model's accepted tokens per row and drafting step: decayed sums, started at a prior
        self.decay = decay
        self.model_accepted, self.model_steps = prior_accepted * prior_weight, prior_weight
        self.counts = {"lookup_steps": 0, "model_steps": 0}
        self._last: tuple[str, Draft] | None = None  # what drafted this step, and its draft

    @property
    def model_expected(self) -> float:
        """The tokens a row's model draft gets accepted, per drafting step, as measured lately."""
        return self.model_accepted / self.model_steps

    def add(self, prompts: list[list[int]], tenants: list | None = None) -> None:
        self.model.add(prompts)
        if self.lookup.reads_tenants:
            self.lookup.add(prompts, tenants=tenants)
        else:
            self.lookup.add(prompts)

    def observe_taps(self, hidden: list[torch.Tensor | None]) -> None:
        self.model.observe_taps(hidden)

    def catch_up(self, sequences: list[list[int]]) -> None:
        self.model.catch_up(sequences)

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None, constraints: list | None = None) -> Draft:
        grammars = {"constraints": constraints} if constraints is not None and self.lookup.reads_grammars else {}
        found = self.lookup.propose(sequences, draft_len, sampling, generators, **grammars)  # a chain: no alternates
        if draft_len > 0 and bool(found.num_drafted.any()) and float(self.acceptance.expected(found).mean()) >= self.model_expected:
            self.model.propose(sequences, 0, sampling, generators)  # the model skips this step
            self.counts["lookup_steps"] += 1
            self._last = ("lookup", found)
            return replace(found, confidence=None)
        draft = self.model.propose(sequences, draft_len, sampling, generators, stop, branch)
        self.counts["model_steps"] += draft_len > 0
        self._last = ("model", draft) if draft_len > 0 else None
        return draft

    def commit(self, verdict: Verdict) -> None:
        if self._last is not None:
            kind, draft = self._last
            if kind == "lookup":
                self.acceptance.observe(draft.confidence[:, : draft.tokens.shape[1]], draft.num_drafted, verdict.num_accepted)
            else:
                self.model_accepted = self.model_accepted * self.decay + float(verdict.tokens_from_draft().float().mean())
                self.model_steps = self.model_steps * self.decay + 1
        self._last = None
        self.model.commit(verdict)
        self.lookup.commit(verdict)

    def select(self, rows: list[int]) -> None:
        self.model.select(rows)
        self.lookup.select(rows)

    def figures(self) -> dict:
        return {**self.counts, **self.model.figures()}
