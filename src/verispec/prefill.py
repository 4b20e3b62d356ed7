"""Prompt prefill: each prompt read into its own one-row cache in chunks whose ends depend on its own tokens only.

A float32 pass may round a row differently at another pass width, so a prompt is read in passes over
chunks fixed by the tokens alone (`Chunking`): a chunk ends after at most `CausalLM.prefill_chunk` tokens
and also right after a chat-turn start token (`CausalLM.turn_start_ids`). Whether a chunk ends at position p
depends on the tokens before p only, so two prompts that share a prefix are cut alike within it, and the
numbers of a chunk's keys and values depend on the prompt's tokens only: not on batch mates, not on how
many chunks were read at once, not on whether a prefix came from a `PrefixCache`. The target and a draft
model prefill the same way. `left_pad` lays out rows of different lengths for a shared pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from verispec.models.base import CausalLM, ModelCache


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """rows of different lengths -> (tokens [batch, width] long, visible [batch, width] bool), right-aligned."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    visible = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            tokens[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            visible[b, width - len(r) :] = True
    return tokens, visible


# A chunk a turn start ends is "short" below this many tokens, and no two short chunks follow each other (the
# cap always cuts): a prompt of many tiny turns is still read in passes of MIN_TURN_CHUNK + 1 tokens per two
# passes at worst, while the short last question of a conversation, after a long chunk, still ends a chunk.
# 32 is the widest pass of the exact small-pass kernels (`kernels.MAX_ROWS`). That worst case, 1024 tokens each
# a turn start (62 passes), took SmolLM2 6.3 s against 4.5 s for 1024 random tokens (4 passes), one thread of
# a loaded AMD EPYC, 2026-11-26 (bench/reports/prefix_cache.md).
MIN_TURN_CHUNK = 32


@dataclass(frozen=True)
class Chunking:
    """Where a prompt's prefill passes end, a pure function of its tokens: a chunk ends after `cap` tokens, or
    right after a token of `cut_after`, unless both it and the chunk before it would be shorter than
    `min_len`. The decision to end a chunk at position p reads tokens[:p] only, so every prefix of a
    prompt is cut as the prompt is: a conversation's next turn is cut like the previous turn up to that
    turn's last cut, and finds those chunks in a `PrefixCache` as the very passes a fresh read would run."""

    cap: int  # most tokens per chunk (`CausalLM.prefill_chunk`)
    cut_after: frozenset[int] = frozenset()  # token ids a chunk also ends right after (turn starts)
    min_len: int = MIN_TURN_CHUNK  # a chunk shorter than this may not follow another one

    @classmethod
    def of(cls, model: CausalLM) -> "Chunking | None":
        """The model's chunking, or None where any split gives the same numbers (`prefill_chunk` None)."""
        if not model.prefill_chunk:
            return None
        cap = model.prefill_chunk
        return cls(cap, frozenset(model.turn_start_ids), min(MIN_TURN_CHUNK, cap))

    def ends(self, tokens: list[int]) -> list[int]:
        """Ascending chunk ends in (0, len(tokens)] fixed by the tokens; the prompt's own end is not among
        them unless a rule puts one there (a tail chunk ends where the prompt does)."""
        ends, last, after_long = [], 0, False  # the prompt's start counts as after a short chunk
        cuts = [p + 1 for p, token in enumerate(tokens) if token in self.cut_after] if self.cut_after else []
        for end in cuts + [len(tokens) + self.cap + 1]:  # a sentinel past the end flushes the capped chunks
            while end - last > self.cap:
                last += self.cap
                ends.append(last)
                after_long = True
            long = end - last >= self.min_len
            if end <= len(tokens) and (long or after_long):
                ends.append(end)
                last, after_long = end, long
        return [end for end in ends if end <= len(tokens)]


class PromptReader:
    """One prompt read into a fresh one-row cache, in the model's chunks (`Chunking.of(model)`), each chunk
    a pass of its own, whatever else is being read or decoded. So a chunk's keys and values are the same
    bits with or without a prefix cache hit before it, and with or without pauses between chunks (the
    server reads a long prompt a few chunks at a time between decoding steps). A model with
    `prefill_chunk` None reads any number of tokens per pass.

    prefix_cache: look the prompt up at the first `advance` (the hit is written into the cache, not computed),
    and store the chunks computed here that end where `Chunking.ends` puts an end, under `salt` (see
    `PrefixCache.lookup`). taps (see `CausalLM.forward`): collect the tapped hidden states of every token
    read ([tokens, n * hidden] in `hidden`), or with `tap_last` of the last that many tokens only (passes
    before them run without taps, the same numbers); no prefix cache then, since it keeps no hidden states."""

    def __init__(self, model: CausalLM, tokens: list[int], prefix_cache=None, taps: tuple[int, ...] | None = None,
                 salt: str = "", tap_last: int | None = None):
        self.model, self.tokens, self.taps, self.salt = model, list(tokens), taps, salt
        # the first token whose taps are collected
        self.tap_from = 0 if tap_last is None else max(0, len(self.tokens) - tap_last)
        self.prefix_cache = prefix_cache if taps is None else None
        chunking = Chunking.of(model)
        self._ends = chunking.ends(self.tokens) if chunking else None  # the chunk ends a cache may store
        self.cache = model.new_cache(1)
        self.hidden: list[torch.Tensor] = []
        self.seconds = 0.0  # time spent in the model's passes
        self.reused = 0  # tokens taken from the prefix cache
        self.read = 0  # tokens in the cache
        self._looked_up = self.prefix_cache is None or not self.tokens

    @property
    def done(self) -> bool:
        return self._looked_up and self.read >= len(self.tokens)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.read

    @torch.inference_mode()
    def advance(self, budget: float = float("inf"), at_least_one: bool = True) -> int:
        """Read at most `budget` more tokens: whole chunks while they fit (a model without chunks reads
        min(budget, remaining) tokens), and with `at_least_one` one chunk even past the budget, so a prompt
        always moves on. Returns the tokens read."""
        started = time.perf_counter()
        if not self._looked_up:
            # at the first read, not before: a prompt queued behind the same prompt (n choices, a retry) finds
            # the chunks the first one stored meanwhile
            self._looked_up = True
            self.reused = self.read = self.prefix_cache.load(self.tokens, self.cache, self.salt)
        begin = self.read
        while not self.done:
            if self._ends is not None:
                end = next((e for e in self._ends if e > self.read), len(self.tokens))
            else:
                end = self.read + int(min(max(budget - (self.read - begin), 1), self.remaining))
            if end - begin > budget and (self.read > begin or not at_least_one):
                break
            self._pass(self.read, end)
            if self._ends is None:
                break
        if self.prefix_cache is not None:
            # chunks the rule ends only: a tail cut by the prompt's end is a pass of another width (a granular
            # cache, any split exact, keeps it too)
            if self._ends is None:
                block = self.prefix_cache.block_tokens
                stored = self.read if self.done else self.read - self.read % block
            else:
                stored = max((e for e in self._ends if e <= self.read), default=0)
            if stored > self.reused:
                self.prefix_cache.insert(self.tokens[:stored], self.cache, salt=self.salt)
        self.seconds += time.perf_counter() - started
        return self.read - begin

    def _pass(self, begin: int, end: int) -> None:
        if self.taps is not None and self._ends is None and begin < self.tap_from < end:
            # any split gives the same numbers here, so only the tokens whose taps are kept pay for tapping (a
            # tapped pass runs its layers in segments, and copies every tap out: ~9% of a long q8 prefill)
            self._pass(begin, self.tap_from)
            begin = self.tap_from
        tokens = torch.tensor([self.tokens[begin:end]], dtype=torch.long)
        if self.taps is not None and end > self.tap_from:
            _, tapped = self.model.forward(tokens, self.cache, last_only=True, taps=self.taps)
            self.hidden.append(tapped[0, max(0, self.tap_from - begin) :])
        else:
            self.model.extend(tokens, self.cache)
        self.read = end


@torch.inference_mode()
def prefill(model: CausalLM, contexts: list[list[int]], taps: tuple[int, ...] | None = None, prefix_cache=None):
    """A new cache of len(contexts) rows, row b holding contexts[b] (logits are not needed: the last
    prompt token opens the first decode step). Each context is read on its own (`PromptReader`), so a row's
    numbers do not depend on its batch mates.

    taps (see `CausalLM.forward`): return (cache, hidden) instead, hidden[b] [len(contexts[b]), n * H] the
    tapped hidden states of context b's tokens, for a drafter that reads them (`drafters.eagle3`)."""
    readers = read_once(model, contexts, taps=taps, prefix_cache=prefix_cache)
    return joined(model, readers, taps is not None)


def read_once(model: CausalLM, contexts: list[list[int]], taps: tuple[int, ...] | None = None,
              prefix_cache=None, tap_last: int | None = None) -> list[PromptReader]:
    """A done `PromptReader` per context, the same reader for equal contexts: n samples of one prompt (a
    request's `n`, a statistical test's thousands of seeded rows) read it once, and `joined` copies its
    row. A reader's numbers depend on its own tokens only, so sharing one is the same as reading again."""
    distinct: dict[tuple[int, ...], PromptReader] = {}
    readers = []
    for context in contexts:
        key = tuple(context)
        if key not in distinct:
            distinct[key] = PromptReader(model, context, prefix_cache, taps, tap_last=tap_last)
            distinct[key].advance()
        readers.append(distinct[key])
    return readers


def check_read(model: CausalLM, readers: list[PromptReader], contexts: list[list[int]]) -> None:
    """Raise ValueError unless readers[i] has read contexts[i] whole, on `model` (readers handed in from outside:
    the server reads prompts between steps)."""
    if len(readers) != len(contexts) or any(reader.model is not model or not reader.done or reader.tokens != list(context)
                                            for reader, context in zip(readers, contexts)):
        raise ValueError(f"each reader must have read its prompt but the last token, on {model.name}")


def joined(model: CausalLM, readers: list[PromptReader], with_hidden: bool = False):
    """The readers' one-row caches as one cache, in order (and their tapped hidden states, with_hidden). A
    reader given several times (`read_once`) is joined once and its row copied."""
    distinct = list({id(reader): reader for reader in readers}.values())  # first appearances, in order
    cache = model.new_cache(0)
    for reader in distinct:
        cache.concat(reader.cache)
    if len(distinct) < len(readers):
        position = {id(reader): i for i, reader in enumerate(distinct)}
        cache.select([position[id(reader)] for reader in readers])
    if not with_hidden:
        return cache
    return cache, [torch.cat(r.hidden) if r.hidden else torch.zeros(0, 0) for r in readers]
