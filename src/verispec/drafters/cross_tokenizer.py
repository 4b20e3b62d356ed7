"""A draft model with a tokenizer of its own (Universal Assisted Generation; vLLM's TLI): any small model
drafts for any target, through text.

The draft keeps its own token sequence and cache, in its own vocabulary. Each round, per row:

1. read the target's new tokens as text (decoded with a few tokens before them, so a tokenizer that drops
   a leading space, or a character split over two byte-level tokens, reads right; a row whose text ends in
   half a character waits for the rest and drafts nothing);
2. bring the draft in line with that text: re-encode the text after an anchor (a point where the draft's
   tokens and the text are known to agree, kept about `window` draft tokens back, so a round re-reads a
   bounded stretch) with the draft tokenizer, keep the longest common prefix of that and the draft's
   cache, trim the rest, and feed the difference;
3. draft k tokens greedily in the draft vocabulary;
4. turn them into the target's tokens: decode them (after a few of the draft's own tokens, for the same
   reasons as 1), then encode the last few target tokens' text plus the new text with the target
   tokenizer and take what follows the context's own tokens (so a boundary reads as the target's
   tokenizer reads it); where the context's tokens merge with the new text (the target already ended a
   word mid-way), the new text alone. The first k are the draft.

The draft is deterministic (`Draft.probs` None), so the verifiers treat it as a point mass q = one-hot:
greedy verification keeps the target's argmax chain (token-identical to plain decoding); speculative
sampling accepts token x with probability p(x) and otherwise draws from p with x removed (renormalized),
block verification does the same with its weights, and the coupled rule races on p alone. Each emitted
token then follows the target's warped distribution exactly, whatever the draft said: exactness never
depends on this drafter, only acceptance does. Sampled rows are still drafted greedily (the draft's
argmax is the best single guess at p's mode); a drafted q would need the target's vocabulary.

Text is the target's as its tokenizer decodes it with special tokens kept, so a chat template's markers
(<|im_start|> ...) reach the draft as text, and become the draft's special tokens where its tokenizer has
them (SmolLM2 and Qwen share ChatML). A target's leading BOS is left out of the text; the draft gets its
own BOS where its tokenizer adds one. A draft token after which the draft model ends (its EOS) closes the
row's draft, its text included (a "<|im_end|>" the target knows is a good guess).

Knows nothing about the verifier, the policy or the engine's cache; it owns the draft model's cache and
rolls it back itself, at the next round (the text, not the verdict, says what to keep). Penalties,
logit_bias and grammars are not applied to the draft (acceptance only). Both tokenizers must be fast
(Rust) tokenizers: they are used through `backend_tokenizer`, which needs no lock across threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict, empty_draft
from verispec.errors import VerispecError
from verispec.models.base import CausalLM
from verispec.prefill import left_pad, prefill
from verispec.sampling import SamplingParams, argmax

# Tokens of context decoded before new ones, and encoded before new text (a UTF-8 character is at most 4 bytes).
CONTEXT_TOKENS = 8


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class _Text:
    """A fast tokenizer as text <-> ids, with special tokens read and written as text."""

    def __init__(self, tokenizer, role: str, name: str):
        if tokenizer is None or not tokenizer.is_fast:  # declared by every transformers tokenizer
            raise VerispecError(f"drafting across tokenizers reads both models' text: the {role} {name!r} needs a fast "
                                "(Rust) tokenizer; load it with one, or give a draft with the target's tokenizer")
        self.backend = tokenizer.backend_tokenizer
        self.size = len(tokenizer)
        self.bos = tokenizer.bos_token_id

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode_after(self, context: list[int], ids: list[int]) -> str:
        """The text `ids` add after `context` (decoded together, so a boundary reads as in the whole)."""
        before, after = self.decode(context), self.decode(context + ids)
        return after[len(before):] if after.startswith(before) else self.decode(ids)


@dataclass
class _Row:
    text_start: int  # target tokens left out of the text (a leading BOS)
    target_read: int = 0  # target tokens whose text is in `text`
    text: str = ""
    aligned: list[int] = field(default_factory=list)  # the draft's tokens for `text` (its BOS first, where it has one)
    cached: list[int] = field(default_factory=list)  # what the draft's cache holds, in order
    anchor_ids: int = 0  # aligned[:anchor_ids] stands for text[:anchor_chars] and is never re-encoded
    anchor_chars: int = 0


class CrossTokenizerDrafter(Drafter):
    def __init__(self, model: CausalLM, target: CausalLM, window: int = 32):
        self.model = model
        self.draft_text = _Text(model.tokenizer, "draft", model.name)
        self.target_text = _Text(target.tokenizer, "target", target.name)
        self.target_vocab_size = target.vocab_size
        self.window = window  # draft tokens re-encoded each round, at most (plus the new text)
        # The draft's own BOS, where its tokenizer puts one before any text (Llama, Gemma; not Qwen or SmolLM2).
        probe = model.tokenizer("a")["input_ids"]
        self.draft_prefix = [probe[0]] if self.draft_text.bos is not None and probe[:1] == [self.draft_text.bos] else []
        # A row with no text yet is fed this one token, so every row has something to draft from.
        self.start_token = self.draft_text.bos if self.draft_text.bos is not None else min(model.eos_token_ids, default=0)
        self.cache = None
        self.rows: list[_Row] = []

    @property
    def prefill_model(self) -> CausalLM:
        return self.model  # `add` prefills the prompts' text on it

    # --- text ------------------------------------------------------------------------------------------

    def _read_target(self, row: _Row, sequence: list[int]) -> bool:
        """Append the text of the target's unread tokens; False while the text would end in half a character."""
        if row.target_read == len(sequence):
            return True
        start = max(row.text_start, row.target_read - CONTEXT_TOKENS)
        context = sequence[start : row.target_read]
        for end in range(len(sequence), max(row.target_read, len(sequence) - 4), -1):
            new = self.target_text.decode_after(context, sequence[row.target_read : end])
            # a replacement character that 4 more tokens did not complete is the text itself: take it
            if not new.endswith("\ufffd") or len(sequence) - row.target_read > 4:
                row.text += new
                row.target_read = end
                break
        return row.target_read == len(sequence)

    def _align(self, row: _Row) -> None:
        """The draft's tokens for the row's text: those before the anchor, then the text after it re-encoded.
        Moves the anchor on to keep about `window` draft tokens after it."""
        fresh = self.draft_text.encode(row.text[row.anchor_chars :])
        row.aligned = row.aligned[: row.anchor_ids] + fresh
        spare = len(fresh) - self.window
        if spare <= 0:
            return
        context = row.aligned[max(len(self.draft_prefix), row.anchor_ids - CONTEXT_TOKENS) : row.anchor_ids]
        settled = self.draft_text.decode_after(context, fresh[:spare])
        # Only where those tokens are exactly that much of the text (not half a character, not a rewritten space).
        if settled and not settled.endswith("\ufffd") and row.text.startswith(settled, row.anchor_chars):
            row.anchor_ids += spare
            row.anchor_chars += len(settled)

    def _target_tokens(self, sequence: list[int], text_start: int, new_text: str) -> list[int]:
        """The target tokens for `new_text` after `sequence`: the context's text and the new text encoded
        together, less the context's own tokens (the new text alone where the two merge across the boundary)."""
        if not new_text:
            return []
        context = self.target_text.decode(sequence[max(text_start, len(sequence) - CONTEXT_TOKENS) :])
        before = self.target_text.encode(context)
        both = self.target_text.encode(context + new_text)
        if both[: len(before)] == before:
            return both[len(before) :]
        return self.target_text.encode(new_text)

    # --- the drafter contract --------------------------------------------------------------------------

    @torch.inference_mode()
    def add(self, prompts: list[list[int]]) -> None:
        rows = []
        for prompt in prompts:
            bos = self.target_text.bos
            row = _Row(text_start=1 if bos is not None and prompt[:1] == [bos] else 0)
            row.target_read = row.text_start
            row.aligned = list(self.draft_prefix)
            row.anchor_ids = len(self.draft_prefix)
            self._read_target(row, prompt)
            self._align(row)
            row.cached = self._feedable(row)[:-1]  # like the target: the last token opens the first step
            rows.append(row)
        new_rows = prefill(self.model, [row.cached for row in rows])
        if self.cache is None or self.cache.batch_size == 0:
            self.cache = new_rows
        else:
            self.cache.concat(new_rows)
        self.rows += rows

    def _feedable(self, row: _Row) -> list[int]:
        return row.aligned if row.aligned else [self.start_token]

    @torch.inference_mode()
    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None) -> Draft:
        batch = len(sequences)
        if draft_len == 0:  # a plain step: catch up at the next draft
            return empty_draft(batch)
        # 1-2. The target's new text, and the draft's tokens for it.
        ready = [self._read_target(row, seq) for row, seq in zip(self.rows, sequences)]
        for row in self.rows:
            self._align(row)
        feeds = [self._feedable(row) for row in self.rows]
        if max(len(f) for f in feeds) + draft_len >= self.model.max_context:
            return empty_draft(batch)  # the draft's context is full: plain steps from here on
        # Keep the longest common prefix of each row's cache and its new tokens, but feed at least one token.
        keep = [min(common_prefix(feed, row.cached), len(feed) - 1) for feed, row in zip(feeds, self.rows)]
        self._trim(torch.tensor(keep, dtype=torch.long))
        tail_tokens, tail_visible = left_pad([feed[k:] for feed, k in zip(feeds, keep)])
        # 3. k draft tokens, greedily, each fed back but the last.
        drafted = torch.zeros(batch, draft_len, dtype=torch.long)
        logits = self.model.forward(tail_tokens, self.cache, tail_visible, last_only=True)[:, -1]
        for i in range(draft_len):
            drafted[:, i] = argmax(logits[:, : self.draft_text.size]).cpu()
            if i + 1 == draft_len:
                break
            logits = self.model.forward(drafted[:, i : i + 1].to(self.model.device), self.cache)[:, -1]
        fed = drafted[:, : draft_len - 1].tolist()
        for row, feed, more in zip(self.rows, feeds, fed):
            row.cached = feed + more
        # 4. Their text, as the target's tokens.
        tokens = torch.zeros(batch, draft_len, dtype=torch.long)
        num_drafted = torch.zeros(batch, dtype=torch.long)
        for b, (row, seq) in enumerate(zip(self.rows, sequences)):
            if not ready[b]:
                continue
            ids = drafted[b].tolist()
            ends = [i for i, t in enumerate(ids) if t in self.model.eos_token_ids]
            ids = ids[: ends[0] + 1] if ends else ids
            new_text = self.draft_text.decode_after(feeds[b][-CONTEXT_TOKENS:], ids).rstrip("\ufffd")
            proposal = self._target_tokens(seq, row.text_start, new_text)[:draft_len]
            # a token the target's logits do not cover (a tokenizer larger than the model) ends the draft
            proposal = proposal[: next((i for i, t in enumerate(proposal) if t >= self.target_vocab_size), len(proposal))]
            tokens[b, : len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            num_drafted[b] = len(proposal)
        return Draft(tokens=tokens, num_drafted=num_drafted, probs=None)

    def _trim(self, keep: torch.Tensor) -> None:
        """Row b of the draft's cache keeps its first keep[b] tokens (holes of left padding skipped)."""
        slots = self.cache.slots
        seen = slots.visible.long().cumsum(1)  # [batch, length]: tokens up to and including each slot
        ends = torch.where(keep > 0, (seen < keep[:, None].to(seen.device)).sum(1).cpu() + 1, torch.zeros_like(keep))
        self.cache.truncate(ends)

    def commit(self, verdict: Verdict) -> None:
        pass  # the next round's text says what the draft's cache keeps (`propose` trims it)

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)
        self.rows = [self.rows[b] for b in rows]
