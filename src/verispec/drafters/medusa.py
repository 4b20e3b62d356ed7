"""Medusa-1 heads as the drafter (Cai et al. 2024): K guesses at once from the target's last hidden state.

The engine hands the drafter the target's final hidden state (after its final norm: tap index = the
target's layer count, `target_taps`) of every token its cache keeps, from the prompt's prefill and each
verify pass, with no extra target pass. Only the last one matters: with the sequence x_0..x_{n-1} and the
target's cache holding x_0..x_{n-2}, h_{n-2} produced x_{n-1} through the target's LM head, and Medusa
head i, reading the same h_{n-2}, guesses x_{n+i}. A round is one small product per head:

    chain  = [argmax head_0, argmax head_1, ..., argmax head_{k-1}]   (k = min(draft_len, K))
    alternates: each head's second choice beside its position, where the branch rule asks for one

so the drafter keeps no cache and rolls nothing back. Greedy rows propose argmaxes over the draft
vocabulary; sampled rows draw each position from q_i, head i's warped distribution spread over the target
vocabulary (zero outside the draft vocabulary), and report it. q_i does not depend on the tokens drafted
before position i, and need not: speculative sampling is exact for any proposal distribution fixed before
the draw, so the output is the target's either way.

Given an `OnlineMedusa` (`heads.online`) instead of fixed heads, the drafter reads the learner's live
weights for each forward (one consistent copy per draft, however often they change) and hands it the
hidden states and tokens it serves, which the learner trains on in the background. Exact all the same.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict, VocabDraft, empty_draft
from verispec.heads.medusa import MedusaHead, check_target
from verispec.heads.online import OnlineMedusa
from verispec.sampling import SamplingParams


class MedusaDrafter(Drafter):
    """Drafts with trained Medusa heads; `target_taps` (the target's final normed state) makes the engine
    hand it the target's last hidden states."""

    def __init__(self, head: MedusaHead | OnlineMedusa, target, min_confidence: float = 0.0):
        check_target(head, target)
        # the heads this drafter reads, and where its traffic goes: fixed heads read as they are, learning ones
        # through their double buffer (`OnlineMedusa.reading`), fed by a recorder of this drafter's rows
        self.heads = head if isinstance(head, OnlineMedusa) else _Fixed(head.eval())
        self.recorder = head.recorder() if isinstance(head, OnlineMedusa) else None
        self.target_taps = (int(target.config.num_hidden_layers),)  # the final hidden state, after the norm
        self.vocab_size = target.vocab_size
        self.min_confidence = min_confidence
        self.last: list[torch.Tensor | None] = []  # per row: the target's final hidden state [H] at its last kept token
        self.kept: list[int] = []  # per row: tokens in the target's cache (positions observed)

    def add(self, prompts: list[list[int]]) -> None:
        """New rows: their prompt's hidden states arrive through `observe_taps`."""
        self.last.extend(None for _ in prompts)
        self.kept.extend(0 for _ in prompts)
        if self.recorder is not None:
            self.recorder.add(prompts)

    def observe_taps(self, hidden: list[torch.Tensor | None]) -> None:
        """Per row, the target's final hidden states [n, H] of the n tokens its cache just kept."""
        for b, states in enumerate(hidden):
            if states is not None and states.numel():
                self.last[b] = states[-1].float().cpu()
                self.kept[b] += states.shape[0]
        if self.recorder is not None:
            self.recorder.observe(hidden)

    @torch.inference_mode()
    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None) -> Draft:
        batch = len(sequences)
        for b in range(batch):
            if self.kept[b] != len(sequences[b]) - 1:
                raise RuntimeError(f"row {b}: the drafter saw {self.kept[b]} of the target's hidden states, but the "
                                   f"target's cache holds {len(sequences[b]) - 1} tokens")
        if self.recorder is not None:  # the tokens after every observed position are known now
            self.recorder.cut(sequences)
        known = torch.tensor([state is not None for state in self.last])  # a one-token prompt: nothing read yet
        config = self.heads.config
        width = min(draft_len, config.num_heads)
        if width == 0 or not bool(known.any()):
            return empty_draft(batch)
        hidden = torch.stack([state if state is not None else torch.zeros(config.hidden_size) for state in self.last])
        with self.heads.reading() as head:  # one copy of the weights for the whole draft
            all_logits = head(hidden, heads=width)  # [B, width, V] over the draft vocabulary: every head at once
            draft_ids = head.draft_token_ids
        built = VocabDraft(sequences, width, self.vocab_size, draft_ids, sampling, generators, branch)
        num_drafted = torch.zeros(batch, dtype=torch.long)
        going = known.clone()
        for i in range(width):
            confidence = built.choose(i, all_logits[:, i])
            if stop is not None:
                going &= stop(i, confidence)
            if self.min_confidence:
                going &= confidence >= self.min_confidence
            num_drafted += going.long()
            if not going.any():
                break
        return built.draft(num_drafted)

    def commit(self, verdict: Verdict) -> None:
        """Nothing to roll back: the drafter keeps only hidden states of tokens the target's cache kept."""

    def select(self, rows: list[int]) -> None:
        self.last = [self.last[b] for b in rows]
        self.kept = [self.kept[b] for b in rows]
        if self.recorder is not None:
            self.recorder.select(rows)


class _Fixed:
    """Fixed heads, read as `OnlineMedusa` reads its live copy."""

    def __init__(self, head: MedusaHead):
        self.head, self.config = head, head.config

    @contextmanager
    def reading(self) -> Iterator[MedusaHead]:
        yield self.head
