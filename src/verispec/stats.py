"""What a run measured, in the field's words, and what the speedup formula predicts from it.

Kept apart from where it is shown (CLI table, JSON, Prometheus). Expected tokens per target pass
with per-position acceptance a_i (the probability that draft position i is accepted, given the ones
before it were) is E = 1 + sum_i prod_{j<=i} a_j; with one acceptance rate alpha this is
(1 - alpha^(k+1)) / (1 - alpha). The predicted speedup over plain decoding is E / (k c + 1), where c is
the cost of one draft step relative to one target pass (Leviathan et al. 2023, Thm 3.8).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch


def expected_tokens_per_step(alpha: float, draft_len: int) -> float:
    """E[tokens per target pass] for i.i.d. acceptance rate alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return draft_len + 1.0
    return (1.0 - alpha ** (draft_len + 1)) / (1.0 - alpha)


def predicted_speedup(tokens_per_step: float, draft_len: int, cost_ratio: float) -> float:
    """E / (k c + 1)."""
    return tokens_per_step / (draft_len * cost_ratio + 1.0)


def acceptance_rate_from_distributions(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q), over the last dimension."""
    return torch.minimum(p, q).sum(-1)


class AlternateOutcome(NamedTuple):
    """The alternates of a step whose target pass carried a token tree, per alternate [batch, m]."""

    present: torch.Tensor  # [batch, m] bool: the draft's alternates (in the leaf form m = k: beside chain position i)
    confidence: torch.Tensor  # [batch, m] float32: the draft's probability of each alternate
    reached: torch.Tensor  # [batch, m] bool: the target's token at its place was decided (the path got there)
    accepted: torch.Tensor  # [batch, m] bool: it was taken (it is on the row's accepted path)

    @classmethod
    def of(cls, draft, verdict) -> "AlternateOutcome":
        """The outcome of a draft with alternates (`drafters.base.Draft`) under its verdict: an alternate's place
        is reached when the accepted path holds the column it hangs from."""
        tree, m = draft.tree, draft.alternates.shape[1]
        present = draft.alternates >= 0
        confidence = draft.alternate_confidence if draft.alternate_confidence is not None else torch.zeros(present.shape)
        reached = torch.zeros(present.shape, dtype=torch.bool)
        accepted = torch.zeros(present.shape, dtype=torch.bool)
        kept = verdict.kept_columns(draft, tree.mask.shape[1])
        for b, column in (tree.source >= 0).nonzero().tolist():
            j = int(tree.source[b, column])
            reached[b, j] = bool(kept[b, tree.parent[b, column]])
            accepted[b, j] = bool(kept[b, column])
        return cls(present, confidence[:, :m], reached, accepted)

    @property
    def taken(self) -> torch.Tensor:
        """[batch] long: tokens each row gained from its alternates."""
        return self.accepted.sum(1)


@dataclass
class StepRecord:
    """What one decoding step did, as the engine reports it to whoever learns from it: the draft-length
    policy, the stats, the server. Positional order: batch_size, draft_len, width, num_drafted,
    num_accepted, draft_seconds, target_seconds."""

    batch_size: int
    draft_len: int  # k the policy chose (0: a plain step)
    width: int  # 1 + the chain's positions in the target pass (1: nothing was drafted)
    num_drafted: torch.Tensor  # [batch] long: chain tokens each row proposed
    num_accepted: torch.Tensor  # [batch] long: ... and had accepted
    draft_seconds: float  # the drafter's part of the step, catch_up_seconds included
    target_seconds: float  # the target's pass plus verification and rollback: what a wider pass adds to
    confidence: torch.Tensor | None = None  # [batch, width - 1] float32: the draft's probability of its tokens, if it reports them
    extra_rows: int = 0  # alternate columns after the chain in the target pass
    alternates: AlternateOutcome | None = None  # when the pass carried alternates
    verify_seconds: float = 0.0  # the part of target_seconds spent verifying and rolling back
    # the part of draft_seconds spent reading what the drafter skipped while the steps before did not draft
    # (`Drafter.catch_up`): a cost of those steps, not of this step's draft tokens
    catch_up_seconds: float = 0.0
    emitted: torch.Tensor | None = None  # [batch] long: tokens handed out (after max_new_tokens, EOS and stop cuts)
    lossy: torch.Tensor | None = None  # [batch] bool: the row was judged by a lossy rule it asked for

    def rows(self, index: torch.Tensor) -> "StepRecord":
        """The record of these rows only (index [n] long): the same pass, its seconds shared."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        alternates = None if self.alternates is None else AlternateOutcome(*(t[index] for t in self.alternates))
        return replace(self, batch_size=len(index), num_drafted=self.num_drafted[index], num_accepted=self.num_accepted[index],
                       confidence=pick(self.confidence), alternates=alternates, emitted=pick(self.emitted), lossy=pick(self.lossy))


@dataclass
class SpecStats:
    """Counters for one generate call (all rows together)."""

    target_passes: int = 0  # target forward passes after the prompt (one per step)
    sequence_steps: int = 0  # (row, step) pairs: each yields accepted + 1 tokens
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens returned to the caller (after max_new_tokens / stop cuts)
    prompt_tokens: int = 0  # prompt tokens admitted (prompt evaluation: the prefill)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    overhead_seconds: float = 0.0  # verification and rollback
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    draft_len_sum: int = 0  # sum over steps of the draft length k asked for
    max_draft_len: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times proposed
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    alternates_drafted: int = 0  # token-tree candidates beside the chain (second guesses, a dynamic tree's nodes)
    alternates_accepted: int = 0  # ... taken after the chain's accepted prefix (tokens gained from them)
    drafter: str = ""  # which drafter the call ran (a draft model whose start did not pay gives way to prompt lookup)
    drafter_figures: dict = field(default_factory=dict)  # what that drafter reports of its own work (`Drafter.figures`)
    lossy: bool = False  # some row was verified by a lossy rule it asked for (typical acceptance, a cascade): not the target's output

    def observe(self, step: StepRecord) -> None:
        """Record one verification step (of the rows these stats count)."""
        drafted_positions = step.width - 1  # the chain's positions in the pass
        self.target_passes += 1
        self.sequence_steps += step.batch_size
        self.drafted_tokens += int(step.num_drafted.sum())
        self.accepted_tokens += int(step.num_accepted.sum())
        self.draft_len_sum += drafted_positions
        self.max_draft_len = max(self.max_draft_len, drafted_positions)
        while len(self.drafted_at) < drafted_positions:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted_positions):
            self.drafted_at[i] += int((step.num_drafted > i).sum())
            self.accepted_at[i] += int((step.num_accepted > i).sum())
        if step.alternates is not None:
            self.alternates_drafted += int(step.alternates.present.sum())
            self.alternates_accepted += int(step.alternates.taken.sum())
        self.draft_seconds += step.draft_seconds
        self.target_seconds += step.target_seconds - step.verify_seconds
        self.overhead_seconds += step.verify_seconds
        if step.emitted is not None:
            self.emitted_tokens += int(step.emitted.sum())
        self.lossy = self.lossy or (step.lossy is not None and bool(step.lossy.any()))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(position i accepted | position i proposed), i = 1..k (unconditional on earlier positions)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per target pass per sequence, the bonus/recovered token and accepted alternates included
        (plain decoding: 1.00)."""
        if not self.sequence_steps:
            return 0.0
        return (self.accepted_tokens + self.alternates_accepted + self.sequence_steps) / self.sequence_steps

    @property
    def mean_draft_len(self) -> float:
        return self.drafted_tokens / self.sequence_steps if self.sequence_steps else 0.0

    @property
    def mean_step_draft_len(self) -> float:
        """k: mean draft length asked for per step."""
        return self.draft_len_sum / self.target_passes if self.target_passes else 0.0

    @property
    def cost_ratio(self) -> float:
        """c: seconds per drafted position / seconds per target pass (measured)."""
        if not self.draft_len_sum or not self.target_seconds:
            return 0.0
        return (self.draft_seconds / self.draft_len_sum) / (self.target_seconds / self.target_passes)

    @property
    def predicted_speedup(self) -> float:
        """E / (k c + 1) with E, k and c as measured."""
        if not self.sequence_steps:
            return 0.0
        return self.mean_accepted_tokens / (self.mean_step_draft_len * self.cost_ratio + 1.0)

    @property
    def tokens_per_second(self) -> float:
        """Emitted tokens over the whole call, prompt evaluation included."""
        return self.emitted_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        """Prompt evaluation: prompt tokens per second of prefill."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Evaluation: emitted tokens per second of decoding, after the prefill."""
        decoding = self.total_seconds - self.prefill_seconds
        return self.emitted_tokens / decoding if decoding > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "drafter": self.drafter,
            "lossy": self.lossy,
            "target_passes": self.target_passes,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
            "alternates_drafted": self.alternates_drafted,
            "alternates_accepted": self.alternates_accepted,
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "mean_draft_len": round(self.mean_draft_len, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_per_second": round(self.prompt_tokens_per_second, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
            "draft_seconds": round(self.draft_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "overhead_seconds": round(self.overhead_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "total_seconds": round(self.total_seconds, 4),
            "cost_ratio": round(self.cost_ratio, 4),
            "predicted_speedup": round(self.predicted_speedup, 4),
        }

    def summary(self) -> str:
        d = self.to_dict()
        return (
            (f"{d['drafter']}: " if d["drafter"] else "")
            + f"prompt eval {d['prompt_tokens']} tokens in {d['prefill_seconds']:.2f}s ({d['prompt_tokens_per_second']:.2f} tok/s), "
            f"eval {d['emitted_tokens']} tokens in {d['total_seconds'] - d['prefill_seconds']:.2f}s "
            f"({d['decode_tokens_per_second']:.2f} tok/s), "
            f"{d['target_passes']} target passes, {d['mean_accepted_tokens']:.2f} tokens/pass, "
            f"acceptance {d['acceptance_rate']:.2%} ({d['accepted_tokens']}/{d['drafted_tokens']}), "
            f"cost ratio c={d['cost_ratio']:.3f}, predicted speedup {d['predicted_speedup']:.2f}x"
            + (", LOSSY (typical acceptance or a speculative cascade: not the target's own output)" if self.lossy else "")
        )
