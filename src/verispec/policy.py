"""How many tokens to draft next step: fixed, or chosen from measured costs and acceptance.

The adaptive policy maximises predicted tokens per second (Leviathan et al. 2023, Sec. 3.4, with the
verify pass's real cost instead of "free"):

    rate(k) = E(k) / (k * t_draft + t_verify(k + 1)),   E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j

where a_j is the measured probability that draft position j is accepted given j - 1 was, t_draft
the measured seconds per drafted token, and t_verify(w) the measured seconds of a target pass of
width w at the current batch size (on a CPU a wider pass is *not* free). k = 0 is plain decoding:
when no k beats it, the engine does not speculate, and it probes now and then so the estimates can
recover. Knows nothing about models or tokens: only numbers the engine reports.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

import torch


class DraftPolicy(Protocol):
    def choose(self, batch_size: int) -> int:
        """Draft length for the next step (0 = plain decoding)."""
        ...

    def observe(self, batch_size: int, draft_len: int, width: int, num_drafted: torch.Tensor, num_accepted: torch.Tensor,
                draft_seconds: float, target_seconds: float) -> None:
        """Learn from one step: num_drafted, num_accepted [batch] long; width = tokens in the target pass."""
        ...


class FixedDraftLen:
    def __init__(self, draft_len: int):
        self.draft_len = draft_len

    def choose(self, batch_size: int) -> int:
        return self.draft_len

    def observe(self, *args, **kwargs) -> None:
        pass


class _Ema:
    """Exponentially weighted mean that starts at the first observation."""

    def __init__(self, decay: float):
        self.decay, self.value = decay, None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x


class AdaptiveDraftLen:
    """Chooses k from running estimates of acceptance and costs; see the module docstring."""

    def __init__(self, max_draft_len: int = 8, decay: float = 0.9, probe_every: int = 16, prior_acceptance: float = 0.6):
        self.max_draft_len = max_draft_len
        self.decay = decay
        self.probe_every = probe_every
        # Conditional acceptance per draft position as decayed counts, with a weak prior.
        self.accepted = torch.full((max_draft_len,), prior_acceptance)
        self.reached = torch.ones(max_draft_len)
        self.draft_cost: dict[int, _Ema] = defaultdict(lambda: _Ema(decay))  # batch size -> s per drafted token
        self.verify_cost: dict[tuple[int, int], _Ema] = defaultdict(lambda: _Ema(decay))  # (batch, width) -> s
        self.steps_without_drafting = 0
        self.last_rates: dict[int, float] = {}

    def acceptance(self) -> torch.Tensor:
        """[max_draft_len] a_j: P(position j accepted | position j - 1 accepted)."""
        return self.accepted / self.reached

    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j."""
        return 1.0 + float(self.acceptance()[:k].cumprod(0).sum())

    def _verify_seconds(self, batch_size: int, width: int) -> float | None:
        measured = {w: e.value for (b, w), e in self.verify_cost.items() if b == batch_size and e.value is not None}
        if width in measured:
            return measured[width]
        narrower = [w for w in measured if w < width]
        # Unmeasured width: assume it costs what the widest narrower one does (optimistic, so it gets tried once).
        return measured[max(narrower)] if narrower else None

    def predicted_rates(self, batch_size: int) -> dict[int, float]:
        """k -> predicted tokens per second per sequence, for every k we can price."""
        plain = self._verify_seconds(batch_size, 1)
        draft = self.draft_cost[batch_size].value
        rates = {0: 1.0 / plain} if plain else {}
        for k in range(1, self.max_draft_len + 1):
            verify = self._verify_seconds(batch_size, k + 1)
            if verify is None:
                continue
            rates[k] = self.expected_tokens(k) / (k * (draft or 0.0) + verify)
        return rates

    def choose(self, batch_size: int) -> int:
        if self.verify_cost[(batch_size, 1)].value is None:
            return 0  # measure plain decoding at this batch size first: it is what every k must beat
        if self.draft_cost[batch_size].value is None:
            return min(4, self.max_draft_len)  # and what a drafted token costs
        self.last_rates = self.predicted_rates(batch_size)
        best = max(self.last_rates, key=self.last_rates.get)
        if best == 0:
            self.steps_without_drafting += 1
            if self.steps_without_drafting % self.probe_every == 0:
                return 1  # probe, so acceptance and draft cost estimates can recover
        else:
            self.steps_without_drafting = 0
        return best

    def observe(self, batch_size: int, draft_len: int, width: int, num_drafted: torch.Tensor, num_accepted: torch.Tensor,
                draft_seconds: float, target_seconds: float) -> None:
        self.verify_cost[(batch_size, width)].update(target_seconds)
        if draft_len == 0:
            return
        self.draft_cost[batch_size].update(draft_seconds / draft_len)
        positions = torch.arange(1, draft_len + 1)
        # Position j was judged if it was proposed and every earlier position was accepted.
        reached = (num_drafted[:, None] >= positions) & (num_accepted[:, None] >= positions - 1)
        accepted = num_accepted[:, None] >= positions
        self.reached *= self.decay
        self.accepted *= self.decay
        self.reached[:draft_len] += reached.sum(0).float()
        self.accepted[:draft_len] += (accepted & reached).sum(0).float()


def make_policy(draft_len: int | str | None) -> DraftPolicy:
    """An int gives a fixed draft length; "auto" or None the adaptive policy."""
    from verispec.errors import VerispecError

    if draft_len is None or draft_len == "auto":
        return AdaptiveDraftLen()
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
        raise VerispecError(f"draft_len must be an integer >= 1 or 'auto', got {draft_len!r}")
    return FixedDraftLen(draft_len)
