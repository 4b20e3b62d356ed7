"""Prompt lookup / n-gram drafting: no model, just the text so far.

If the last n tokens occurred before (in the prompt or the output), propose what followed them
there, trying the longest n first and the most recent occurrence (Saxena 2023, "prompt lookup
decoding"; Yang et al. 2023, LLMA). The draft is deterministic, so it carries no probabilities. Under a
grammar (structured output) a row's draft ends before the first token its grammar forbids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.grammar import Constraint


class _RowIndex:
    """For each n, the n-gram -> index just past its latest occurrence, for one sequence."""

    def __init__(self, ngram_sizes: range):
        self.ngram_sizes = ngram_sizes
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ngram_sizes}
        self.indexed_upto = 0  # every n-gram that ends before this index (and has a successor) is in the tables

    def update(self, sequence: list[int]) -> None:
        # Only n-grams with a following token are useful, so index up to len - 1.
        for end in range(max(self.indexed_upto, 1), len(sequence)):
            for n in self.ngram_sizes:
                if end >= n:
                    self.tables[n][tuple(sequence[end - n : end])] = end
        self.indexed_upto = max(self.indexed_upto, len(sequence))

    def lookup(self, sequence: list[int], draft_len: int) -> list[int]:
        for n in reversed(self.ngram_sizes):
            if len(sequence) <= n:
                continue
            follow = self.tables[n].get(tuple(sequence[-n:]))
            if follow is not None:
                return sequence[follow : follow + draft_len]
        return []


class NgramDrafter(Drafter):
    reads_grammars = True  # a draft is cut at the first token its row's grammar forbids

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise VerispecError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.ngram_sizes = range(min_ngram, max_ngram + 1)
        self.rows: list[_RowIndex] = []

    def add(self, prompts: list[list[int]]) -> None:
        self.rows += [_RowIndex(self.ngram_sizes) for _ in prompts]

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None,
                constraints: "list[Constraint | None] | None" = None) -> Draft:
        for index, sequence in zip(self.rows, sequences):
            index.update(sequence)
        return self.lookahead(sequences, draft_len, sampling, constraints=constraints)

    def lookahead(self, contexts: list[list[int]], draft_len: int, sampling: list[SamplingParams],
                  stop: StopRule | None = None, branch: BranchRule | None = None,
                  constraints: "list[Constraint | None] | None" = None) -> Draft:
        """The draft that would follow each row's context, which may end in speculative tokens (another
        drafter's, `StagedDrafter`), without indexing it: the index holds accepted text only. constraints:
        per row, its grammar at the end of its context (None: no grammar), whose first forbidden token
        ends the row's draft."""
        tokens = torch.zeros(len(contexts), draft_len, dtype=torch.long)
        num_drafted = torch.zeros(len(contexts), dtype=torch.long)
        for row, (index, sequence) in enumerate(zip(self.rows, contexts)):
            continuation = index.lookup(sequence, draft_len)
            if constraints and constraints[row] is not None:
                continuation = continuation[: constraints[row].valid_prefix(continuation)]
            tokens[row, : len(continuation)] = torch.tensor(continuation, dtype=torch.long)
            num_drafted[row] = len(continuation)
        return Draft(tokens=tokens, num_drafted=num_drafted, probs=None)

    def commit(self, verdict: Verdict) -> None:
        pass  # the index only ever holds accepted text: it is refreshed from the sequences at propose

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
