"""The speculative decoding loop: draft -> verify -> accept -> roll back, for a batch of sequences.

Each step the drafter proposes up to k tokens per row, the target scores [last token, draft] in one
forward pass, the verifier accepts a prefix and adds one token of the target's own, and every cache
forgets what was rejected. With no drafter this is plain autoregressive decoding, the baseline.
The engine works on token ids only: it knows nothing about text, except through `stop_checker`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from verispec.drafters.base import Drafter
from verispec.drafters.model import left_pad
from verispec.errors import VerispecError
from verispec.models.base import CausalLM
from verispec.sampling import SamplingParams, make_generators
from verispec.stats import SpecStats
from verispec.verifiers import verifier_for

# (row, generated token ids so far) -> how many generated tokens to keep if a stop sequence ended, else None
StopChecker = Callable[[int, list[int]], "int | None"]


@dataclass
class TokenEvent:
    """The tokens one sequence gained in one step."""

    row: int  # index of the sequence in the caller's batch
    tokens: list[int]
    from_draft: list[bool]  # per token: accepted from the draft (True) or the target's own (False)
    finish_reason: str | None = None  # "stop" (EOS or stop sequence), "length", or None while running


@dataclass
class _Row:
    index: int  # position in the caller's batch
    sequence: list[int]  # prompt + generated
    prompt_len: int
    limit: int  # most new tokens this row may produce

    @property
    def generated(self) -> list[int]:
        return self.sequence[self.prompt_len :]


class SpeculativeEngine:
    """Generates with a target model and a drafter. Reusable across calls; not thread-safe."""

    def __init__(self, target: CausalLM, drafter: Drafter, draft_len: int = 4):
        if not isinstance(draft_len, int) or draft_len < 1:
            raise VerispecError(f"draft_len must be an integer >= 1, got {draft_len!r}")
        self.target = target
        self.drafter = drafter
        self.draft_len = draft_len

    @torch.inference_mode()
    def stream(
        self,
        prompts: list[list[int]],
        *,
        sampling: SamplingParams = SamplingParams(),
        max_new_tokens: int = 128,
        stop_checker: StopChecker | None = None,
        stats: SpecStats | None = None,
    ) -> Iterator[TokenEvent]:
        """Yield TokenEvents until every row has finished. prompts: token ids per row (non-empty)."""
        started = time.perf_counter()
        stats = stats if stats is not None else SpecStats()
        rows = self._admit(prompts, max_new_tokens)
        verifier = verifier_for(sampling)
        generators = make_generators(sampling, len(rows))
        target_cache = self.target.new_cache(len(rows))
        try:
            # Prefill: the target caches every prompt token but the last, which opens the first step.
            context, visible = left_pad([row.sequence[:-1] for row in rows])
            if context.shape[1]:
                self.target.forward(context, target_cache, visible, last_only=True)
            self.drafter.start([row.sequence for row in rows])
            stats.prefill_seconds += time.perf_counter() - started

            while rows:
                k = self._step_draft_len(rows)
                t0 = time.perf_counter()
                draft = self.drafter.propose([row.sequence for row in rows], k, sampling, generators)
                t1 = time.perf_counter()
                # 1. One target pass scores the last token and every drafted one.
                last = torch.tensor([[row.sequence[-1]] for row in rows], dtype=torch.long)
                start = target_cache.slots.length
                logits = self.target.forward(torch.cat([last, draft.tokens], 1), target_cache)
                t2 = time.perf_counter()
                # 2. Accept a prefix, add the target's own token.
                verdict = verifier.verify(draft, logits, sampling, generators)
                # 3. Roll back: keep the last token and the accepted draft tokens.
                target_cache.truncate(start + 1 + verdict.num_accepted)
                self.drafter.commit(verdict)
                stats.draft_seconds += t1 - t0
                stats.target_seconds += t2 - t1
                stats.observe(draft.num_drafted, verdict.num_accepted, k)

                # 4. Hand out the new tokens; cut at max_new_tokens, EOS and stop sequences.
                still_running = []
                for b, row in enumerate(rows):
                    event = self._emit(row, verdict.emitted(draft, b), int(verdict.num_accepted[b]), stop_checker)
                    stats.emitted_tokens += len(event.tokens)
                    yield event
                    if event.finish_reason is None:
                        still_running.append(b)
                if len(still_running) < len(rows):
                    rows = [rows[b] for b in still_running]
                    generators = [generators[b] for b in still_running]
                    if rows:
                        target_cache.select(still_running)
                        self.drafter.select(still_running)
        finally:
            stats.total_seconds += time.perf_counter() - started

    def _admit(self, prompts: list[list[int]], max_new_tokens: int) -> list[_Row]:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise VerispecError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not prompts:
            raise VerispecError("no prompts given: pass at least one prompt")
        rows = []
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise VerispecError(f"prompt {index} is empty: give at least one token")
            room = self.target.max_context - len(prompt)
            if room < 1:
                raise VerispecError(
                    f"prompt {index} has {len(prompt)} tokens but {self.target.name} has a context window of "
                    f"{self.target.max_context}: shorten the prompt"
                )
            rows.append(_Row(index=index, sequence=list(prompt), prompt_len=len(prompt), limit=min(max_new_tokens, room)))
        return rows

    def _step_draft_len(self, rows: list[_Row]) -> int:
        # Draft no more than any row can still use, and keep every verified position inside the context.
        most_needed = max(row.limit - len(row.generated) for row in rows) - 1
        context_room = min(self.target.max_context - len(row.sequence) for row in rows)
        return max(0, min(self.draft_len, most_needed, context_room))

    def _emit(self, row: _Row, new_tokens: list[int], num_accepted: int, stop_checker: StopChecker | None) -> TokenEvent:
        from_draft = [True] * num_accepted + [False]
        finish_reason = None
        room = row.limit - len(row.generated)
        if len(new_tokens) >= room:
            new_tokens, finish_reason = new_tokens[:room], "length"
        for i, token in enumerate(new_tokens):
            if token in self.target.eos_token_ids:
                new_tokens, finish_reason = new_tokens[: i + 1], "stop"
                break
        before = len(row.generated)
        row.sequence.extend(new_tokens)
        if stop_checker is not None:
            keep = stop_checker(row.index, row.generated)
            if keep is not None:
                del row.sequence[row.prompt_len + max(keep, before) :]
                new_tokens, finish_reason = row.generated[before:], "stop"
        return TokenEvent(row=row.index, tokens=new_tokens, from_draft=from_draft[: len(new_tokens)], finish_reason=finish_reason)
