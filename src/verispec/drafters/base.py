"""The contract between a drafter, the verifier and the engine.

A drafter proposes up to k tokens per sequence (`Draft`); the verifier answers with a `Verdict`;
the drafter then rolls its own state back with `commit`. The engine owns the sequences and the
target's cache; each drafter owns whatever it keeps (its cache, its n-gram index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.sampling import SamplingParams


@dataclass
class Draft:
    tokens: torch.Tensor  # [batch, k] long; entries at or past num_drafted[b] are padding
    num_drafted: torch.Tensor  # [batch] long, 0..k
    probs: torch.Tensor | None = None  # [batch, k, vocab] float32: q each token was drawn from; None = deterministic draft

    @property
    def draft_len(self) -> int:
        return self.tokens.shape[1]

    def narrow(self, width: int) -> "Draft":
        """The first `width` positions (every row's real proposals, when width >= max(num_drafted))."""
        if width == self.draft_len:
            return self
        probs = None if self.probs is None else self.probs[:, :width]
        return Draft(self.tokens[:, :width], self.num_drafted.clamp(max=width), probs)


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [batch] long: accepted draft tokens, a prefix of each row's draft
    next_tokens: torch.Tensor  # [batch] long: the target's own token after the accepted prefix
    # (recovered from the residual after a rejection, or the bonus token when every drafted token was accepted)

    def emitted(self, draft: Draft, row: int) -> list[int]:
        """The tokens row `row` gains this step: its accepted draft prefix, then the target's token."""
        accepted = int(self.num_accepted[row])
        return draft.tokens[row, :accepted].tolist() + [int(self.next_tokens[row])]


class Drafter(Protocol):
    """Proposes tokens; learns the outcome. Chosen once, when the engine is built."""

    def add(self, prompts: list[list[int]]) -> None:
        """New sequences join the batch, after the current rows."""
        ...

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator]) -> Draft:
        """Up to draft_len tokens to follow each sequence (prompt plus tokens so far); sampling and
        generators are per row, so a sampled draft draws from the same warped distribution as its row."""
        ...

    def commit(self, verdict: Verdict) -> None:
        """Forget state built on rejected draft tokens."""
        ...

    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch (the others finished)."""
        ...


def empty_draft(batch_size: int, device: torch.device | str = "cpu") -> Draft:
    return Draft(
        tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
        num_drafted=torch.zeros(batch_size, dtype=torch.long, device=device),
    )
