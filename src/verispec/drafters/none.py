"""No drafter: plain autoregressive decoding through the same engine, the baseline every speedup is measured against."""

from __future__ import annotations

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict, empty_draft
from verispec.sampling import SamplingParams


class NoDrafter(Drafter):
    def add(self, prompts: list[list[int]]) -> None:
        pass

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None) -> Draft:
        return empty_draft(len(sequences))

    def commit(self, verdict: Verdict) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass
