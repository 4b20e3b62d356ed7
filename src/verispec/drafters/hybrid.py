"""Prompt lookup first, a draft model otherwise: the draft model only pays when the text is new.

Each step, if every row's last few tokens occurred before and the n-gram index can propose the
full k tokens that followed them, that free proposal is the draft (code repeating its own names,
a summary quoting its source); otherwise the draft model drafts. The model skips lookup steps and
catches up on the tokens it missed in one pass when it next drafts; it is made to draft before it
falls too far behind, so that pass stays small.

A step is all lookup or all model for the whole batch, so a `Draft` is one kind: deterministic
(no probabilities) or the model's q. Both are exact for the verifier.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.sampling import SamplingParams


class HybridDrafter(Drafter):
    reads_grammars = True  # both its lookup and its model draft within the rows' grammars

    def __init__(self, model: ModelDrafter, lookup: NgramDrafter | None = None, max_lag: int = 16):
        self.model = model
        self.reads_prompt_readers = model.reads_prompt_readers
        # Matches of two or more tokens only: a single repeated token says little about what follows.
        self.lookup = lookup if lookup is not None else NgramDrafter(min_ngram=2, max_ngram=4)
        self.max_lag = max_lag  # tokens the model may fall behind before it must draft (and catch up)
        self.lookup_steps = 0
        self.model_steps = 0

    def add(self, prompts: list[list[int]], readers=None) -> None:
        self.model.add(prompts, **({} if readers is None else {"readers": readers}))
        self.lookup.add(prompts)

    @property
    def prefill_model(self):
        return self.model.prefill_model

    def _lag(self, sequences: list[list[int]]) -> int:
        seen = self.model.cache.slots.num_tokens().tolist()
        return max(len(seq) - n for seq, n in zip(sequences, seen))

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams],
                generators: list[torch.Generator], stop: StopRule | None = None,
                branch: BranchRule | None = None, constraints=None) -> Draft:
        if draft_len > 0 and self._lag(sequences) + draft_len + 1 <= self.max_lag:
            found = self.lookup.propose(sequences, draft_len, sampling, generators, constraints=constraints)
            if bool((found.num_drafted == draft_len).all()):
                self.model.propose(sequences, 0, sampling, generators)  # the model skips this step
                self.lookup_steps += 1
                return found
        self.model_steps += draft_len > 0
        return self.model.propose(sequences, draft_len, sampling, generators, stop, branch, constraints)

    def commit(self, verdict: Verdict) -> None:
        self.model.commit(verdict)  # nothing to undo after a step it skipped
        self.lookup.commit(verdict)

    def select(self, rows: list[int]) -> None:
        self.model.select(rows)
        self.lookup.select(rows)
