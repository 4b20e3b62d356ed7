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
    # [batch, k] float32: the draft's own probability of each token it proposed (its top probability when
    # greedy); None for drafters that cannot judge their tokens. The policy learns how it predicts acceptance.
    confidence: torch.Tensor | None = None

    @property
    def draft_len(self) -> int:
        return self.tokens.shape[1]

    def narrow(self, width: int) -> "Draft":
        """The first `width` positions (every row's real proposals, when width >= max(num_drafted))."""
        if width == self.draft_len:
            return self
        probs = None if self.probs is None else self.probs[:, :width]
        confidence = None if self.confidence is None else self.confidence[:, :width]
        return Draft(self.tokens[:, :width], self.num_drafted.clamp(max=width), probs, confidence)


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [batch] long: accepted draft tokens, a prefix of each row's draft
    next_tokens: torch.Tensor  # [batch] long: the target's own token after the accepted prefix
    # (recovered from the residual after a rejection, or the bonus token when every drafted token was accepted)

    def emitted(self, draft: Draft, row: int) -> list[int]:
        """The tokens row `row` gains this step: its accepted draft prefix, then the target's token."""
        accepted = int(self.num_accepted[row])
        return draft.tokens[row, :accepted].tolist() + [int(self.next_tokens[row])]


class StopRule(Protocol):
    """Decides, token by token, how far each row's draft goes (the draft length is only a ceiling)."""

    def __call__(self, position: int, confidence: torch.Tensor) -> torch.Tensor:
        """[batch] bool: rows whose draft should include its token at `position` (0-based), given the
        draft's probability for that token. Called for positions 0, 1, ... in order, once each per step."""
        ...


class Drafter(Protocol):
    """Proposes tokens; learns the outcome. Chosen once, when the engine is built."""

    def add(self, prompts: list[list[int]]) -> None:
        """New sequences join the batch, after the current rows."""
        ...

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None) -> Draft:
        """Up to draft_len tokens to follow each sequence (prompt plus tokens so far); sampling and
        generators are per row, so a sampled draft draws from the same warped distribution as its row.
        A drafter that scores its own tokens stops a row where `stop` says so; others ignore it."""
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
