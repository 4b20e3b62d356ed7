"""An independent small model as the drafter (Leviathan et al. 2023; Chen et al. 2023).

The draft model keeps its own cache. Each round it first catches up on the tokens it has not seen
(the last accepted tokens and the target's own token), then drafts k tokens one at a time,
sampling from the same warped distribution q it reports to the verifier (a coupled row draws with the
noise of its seed and position, `sampling.coupled_choice`, which the verifier's race on p reuses). It reports its probability
for each token it proposes, and a row stops early where the step's stop rule says the chance of
acceptance no longer pays for another token (or, with `min_confidence`, at any token below that
probability). Where `branch` says so, it adds an alternate leaf beside a position: a greedy row's second
choice, a sampled row's second draw from q with the chain's token taken out (the verifier needs that
distribution, q', to judge it exactly); the draft never feeds an alternate to itself. A row's
penalties, logit_bias and min_tokens are applied to the draft's logits too, with the draft's own tokens
in the history, so the draft guesses the processed target (acceptance only: any q is exact). On commit
it forgets the draft tokens that were rejected.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict, draw_alternates, empty_draft
from verispec.models.base import CausalLM
from verispec.prefill import PromptReader, check_read, joined, left_pad, prefill
from verispec.grammar import Constraint, mask_logits
from verispec.sampling import SamplingParams, argmax, coupled_choice, greedy_choice, process_logits, sample, warp_rows


class ModelDrafter(Drafter):
    reads_grammars = True
    reads_prompt_readers = True

    def __init__(self, model: CausalLM, target_vocab_size: int, min_confidence: float = 0.0):
        self.model = model
        self.min_confidence = min_confidence  # stop drafting a row when q(token) falls below this
        self.vocab_size = target_vocab_size  # q lives on the target's vocabulary
        self.cache = None
        self._round = None  # (slot length before the round, tail width, draft_len)
        self.prompt_lens: list[int] = []  # per row: where its generated tokens begin (penalties count those)

    @torch.inference_mode()
    def add(self, prompts: list[list[int]], readers: list[PromptReader] | None = None) -> None:
        # Prefill the new rows now (all but the last token, like the target), so a draft step costs
        # what drafting costs: the adaptive draft length learns from that time. readers: those reads, done
        # already (`Drafter.reads_prompt_readers`).
        if readers is not None:
            check_read(self.model, readers, [p[:-1] for p in prompts])
            new_rows = joined(self.model, readers)
        else:
            new_rows = prefill(self.model, [list(p[:-1]) for p in prompts])  # grouped by length, like the target's
        if self.cache is None or self.cache.batch_size == 0:
            self.cache = new_rows
        else:
            self.cache.concat(new_rows)
        self.prompt_lens += [len(p) for p in prompts]

    @property
    def prefill_model(self) -> CausalLM:
        return self.model  # `add` prefills the prompts on it

    def _logits_to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # The draft may pad its embedding differently; tokens the target lacks can never be proposed.
        if logits.shape[-1] >= self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], -1)

    @torch.inference_mode()
    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None,
                constraints: "list[Constraint | None] | None" = None) -> Draft:
        batch = len(sequences)
        if draft_len == 0:  # a plain step: catch up later, in one pass
            self._round = None
            return empty_draft(batch)
        greedy = torch.tensor([s.greedy for s in sampling])
        all_greedy = bool(greedy.all())
        seen = self.cache.slots.num_tokens().tolist()
        tail_tokens, tail_visible = left_pad([seq[n:] for seq, n in zip(sequences, seen)])
        start = self.cache.slots.length

        tokens = torch.zeros(batch, draft_len, dtype=torch.long)
        probs = None if all_greedy else torch.zeros(batch, draft_len, self.vocab_size)
        confidence = torch.zeros(batch, draft_len)
        num_drafted = torch.zeros(batch, dtype=torch.long)
        second_choice = torch.zeros(batch, draft_len, dtype=torch.long) if branch is not None else None
        alternate_confidence = torch.zeros(batch, draft_len) if branch is not None else None
        alternate_probs = torch.zeros(batch, draft_len, self.vocab_size) if branch is not None and not all_greedy else None
        going = torch.ones(batch, dtype=torch.bool)
        fed = 0  # draft tokens fed back into the draft cache
        logits = self.model.forward(tail_tokens, self.cache, tail_visible, last_only=True)[:, -1]
        for i in range(draft_len):
            logits = self._process(self._logits_to_target_vocab(logits.float().cpu()), sequences, tokens, i, sampling, constraints)
            if all_greedy:
                if branch is None:
                    tokens[:, i], confidence[:, i] = greedy_choice(logits)
                else:
                    tokens[:, i] = argmax(logits)
                    top = logits.softmax(-1).topk(2, -1)
                    confidence[:, i] = top.values[:, 0]
                    alternate_confidence[:, i] = top.values[:, 1]
                    second_choice[:, i] = top.indices[:, 1]
            else:  # greedy rows get a one-hot q, from which sampling returns the argmax
                q = warp_rows(logits, sampling)
                probs[:, i] = q
                tokens[:, i] = torch.tensor([coupled_choice(q[b], sampling[b].seed, len(sequences[b]) + i) if sampling[b].coupled
                                             else sample(q[b], generators[b]) for b in range(batch)])
                # Confidence is q's top probability, never q of the sampled token: a stop that depends
                # on which token was drawn keeps some draws and drops others, and the kept ones no longer
                # follow q, so the verifier's min(1, p/q) would be applied to the wrong proposal.
                confidence[:, i] = q.max(-1).values
                if greedy.any():  # a greedy row's one-hot q would say 1: its confidence comes from its logits
                    confidence[greedy, i] = logits[greedy].softmax(-1).max(-1).values
                if branch is not None:
                    draw_alternates(i, logits, q, tokens, greedy, generators, second_choice, alternate_confidence,
                                          alternate_probs)
            if stop is not None:
                going &= stop(i, confidence[:, i])
            if self.min_confidence:
                going &= confidence[:, i] >= self.min_confidence
            num_drafted += going.long()
            if not going.any() or i + 1 == draft_len:  # the last token's successor is never needed
                break
            logits = self.model.forward(tokens[:, i : i + 1], self.cache)[:, -1]
            fed += 1
        self._round = (start, tail_tokens.shape[1], fed)
        alternates = None
        if branch is not None:
            drafted = torch.arange(draft_len)[None, :] < num_drafted[:, None]
            wanted = drafted & (second_choice != tokens) & branch(alternate_confidence, num_drafted)
            alternates = torch.where(wanted, second_choice, -1)
        return Draft(tokens=tokens, num_drafted=num_drafted, probs=probs, confidence=confidence,
                     alternates=alternates, alternate_confidence=alternate_confidence, alternate_probs=alternate_probs)

    def commit(self, verdict: Verdict) -> None:
        if self._round is None:
            return
        start, tail_width, fed = self._round
        # Keep the tail and the accepted draft tokens that were fed back.
        self.cache.truncate(start + tail_width + verdict.num_accepted.clamp(max=fed))

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)
        self.prompt_lens = [self.prompt_lens[b] for b in rows]

    def _process(self, logits: torch.Tensor, sequences: list[list[int]], tokens: torch.Tensor, i: int,
                 sampling: list[SamplingParams], constraints: "list[Constraint | None] | None" = None) -> torch.Tensor:
        """The rows' penalties, logit_bias and min_tokens applied to the draft's logits [batch, vocab] at draft
        position i, with the history the target will judge that position with (the sequence and the draft's
        tokens before i), then their grammars' masks after those tokens. Not needed for exactness (every rule is
        exact for any q); without it a draft that ignores them is rejected wherever they move the target's choice."""
        rows = [b for b, s in enumerate(sampling) if s.processes_logits]
        masked = [b for b, c in enumerate(constraints or ()) if c is not None]
        if not rows and not masked:
            return logits
        logits = logits.clone()
        for b in rows:
            logits[b] = process_logits(logits[b : b + 1], sampling[b], sequences[b] + tokens[b, :i].tolist(), self.prompt_lens[b],
                                       None, self.model.eos_token_ids)[0]
        for b in masked:
            mask_logits(logits[b : b + 1], constraints[b].allowed([tokens[b, :i].tolist()]))
        return logits
