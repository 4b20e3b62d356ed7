"""Prompt prefill: each prompt read into its own one-row cache in the model's aligned chunks.

A prompt is read in passes over fixed positions [0, C), [C, 2C), ... (`CausalLM.prefill_chunk`), alone,
so the numbers of its keys and values depend on its own tokens only: not on batch mates, not on how
many chunks were read at once, not on whether a prefix came from a `PrefixCache`. The target and a draft
model prefill the same way. `left_pad` lays out rows of different lengths for a shared pass.
"""

from __future__ import annotations

import time

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


class PromptReader:
    """One prompt read into a fresh one-row cache, in the model's aligned chunks (`CausalLM.prefill_chunk`):
    passes over positions [0, C), [C, 2C), ... and a partial tail, each chunk a pass of its own, whatever
    else is being read or decoded. So a chunk's keys and values are the same bits with or without a
    prefix cache hit before it, and with or without pauses between chunks (the server reads a long prompt a
    few chunks at a time between decoding steps). A model with `prefill_chunk` None reads any number of
    tokens per pass.

    prefix_cache: look the prompt up at the first `advance` (the hit is written into the cache, not computed),
    and store the whole chunks computed here. taps (see `CausalLM.forward`): collect the tapped hidden states of every
    token read ([tokens, n * hidden] in `hidden`); no prefix cache then, since it keeps no hidden states."""

    def __init__(self, model: CausalLM, tokens: list[int], prefix_cache=None, taps: tuple[int, ...] | None = None):
        self.model, self.tokens, self.taps = model, list(tokens), taps
        self.prefix_cache = prefix_cache if taps is None else None
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
            self.reused = self.read = self.prefix_cache.load(self.tokens, self.cache)
        begin = self.read
        chunk = self.model.prefill_chunk
        while not self.done:
            if chunk:
                end = min(len(self.tokens), (self.read // chunk + 1) * chunk)
            else:
                end = self.read + int(min(max(budget - (self.read - begin), 1), self.remaining))
            if end - begin > budget and (self.read > begin or not at_least_one):
                break
            self._pass(self.read, end)
            if not chunk:
                break
        if self.prefix_cache is not None:
            # whole chunks only: a partial tail is a pass of another width (a granular cache keeps it too)
            block = self.prefix_cache.block_tokens
            stored = len(self.tokens) if self.prefix_cache.granular and self.done else self.read - self.read % block
            if stored > self.reused:
                self.prefix_cache.insert(self.tokens[:stored], self.cache)
        self.seconds += time.perf_counter() - started
        return self.read - begin

    def _pass(self, begin: int, end: int) -> None:
        tokens = torch.tensor([self.tokens[begin:end]], dtype=torch.long)
        if self.taps is not None:
            _, tapped = self.model.forward(tokens, self.cache, last_only=True, taps=self.taps)
            self.hidden.append(tapped[0])
        else:
            self.model.forward(tokens, self.cache, last_only=True)
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
              prefix_cache=None) -> list[PromptReader]:
    """A done `PromptReader` per context, the same reader for equal contexts: n samples of one prompt (a
    request's `n`, a statistical test's thousands of seeded rows) read it once, and `joined` copies its
    row. A reader's numbers depend on its own tokens only, so sharing one is the same as reading again."""
    distinct: dict[tuple[int, ...], PromptReader] = {}
    readers = []
    for context in contexts:
        key = tuple(context)
        if key not in distinct:
            distinct[key] = PromptReader(model, context, prefix_cache, taps)
            distinct[key].advance()
        readers.append(distinct[key])
    return readers


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
