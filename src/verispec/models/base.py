"""The contract between the engine and a model backend.

A backend turns new tokens into logits while appending them to a `ModelCache`. The cache's slot
bookkeeping (`SlotCache`: which slots each row sees) is shared by every backend; the tensors live
in a backend-owned `KVStore`. The engine rolls back with `truncate`, drops finished rows with
`select`, and admits new rows with `concat`. Backends know nothing about drafting or verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from verispec.cache import SlotCache


class KVStore(Protocol):
    """A backend's key/value tensors, laid out [batch, ..., slots, ...] on one shared slot axis."""

    def trim(self, length: int) -> None:
        """Drop every slot at index >= length (all rows)."""
        ...

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` [n] long, in that order."""
        ...

    def concat(self, other: "KVStore", rows: int, other_rows: int) -> None:
        """Append other's rows after ours (rows / other_rows: batch sizes, either side may hold no
        slots yet); the shorter slot axis is padded, and the padding is never visible."""
        ...

    # For a backend with `CausalLM.shares_prefixes` (a prefix cache copies keys/values out and back):

    def gather(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys and values at `slots` [n] long, as copies [layers, kv_heads, n, head_dim]."""
        ...

    def put(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [layers, kv_heads, n, head_dim] (from `gather`) at slots start .. start+n-1 of
        every row (a one-row store, being prefilled), and extend the stored length to there."""
        ...


@dataclass
class ModelCache:
    """A backend's KVStore plus the slot bookkeeping the engine uses for rollback."""

    slots: SlotCache
    store: KVStore

    @property
    def batch_size(self) -> int:
        return self.slots.batch_size

    def truncate(self, ends: torch.Tensor) -> None:
        """Roll back: row b forgets slots >= ends[b] [batch] long."""
        self.slots.truncate(ends)
        self.store.trim(self.slots.length)

    def retain(self, start: int, keep: torch.Tensor) -> None:
        """Roll back a token-tree pass that began at slot `start`: row b keeps the new slots where keep[b]."""
        self.slots.retain(start, keep)
        self.store.trim(self.slots.length)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (the others left the batch)."""
        index = torch.tensor(rows, dtype=torch.long)
        self.slots.select(index)
        self.store.select(index.to(self.slots.device))

    def concat(self, other: "ModelCache") -> None:
        """Admit other's rows (e.g. freshly prefilled requests) at the end of the batch."""
        rows = self.slots.batch_size
        self.slots.concat(other.slots)
        self.store.concat(other.store, rows, other.slots.batch_size)


@runtime_checkable
class CausalLM(Protocol):
    """What the engine needs from a target or draft model.

    Backends subclass it, so they inherit the capability defaults below (a backend that can do more
    says so by setting them); the engine and the drafters read these, never probe for methods.
    """

    vocab_size: int  # logits width
    max_context: int  # positions the model supports
    eos_token_ids: frozenset[int]
    tokenizer: Any  # a transformers tokenizer, or None for token-id-only use
    device: torch.device
    name: str

    numerics: str = "float32"  # whose numbers it computes: "float32" (the model's), "q8" (llama.cpp's on a GGUF file)

    # --- capabilities -------------------------------------------------------------------------------
    supports_trees: bool = False  # forward takes `tree`: several candidate continuations in one pass
    # A pass of up to this many token rows (batch x width) gives each row the numbers it would get alone
    # (the native CPU kernels); verify passes stay within it so they round like the plain steps they
    # stand for. None: no such limit to keep.
    max_exact_rows: int | None = None
    # `lower_precision_copy(weight_dtype)` makes a cheaper copy with this model's layer shapes, which can
    # draft on this model's own cache (drafter="self").
    makes_lower_precision_copies: bool = False
    # Prompt prefill proceeds in chunks of at most C tokens whose ends the prompt's tokens fix (`prefill.Chunking`),
    # with or without a prefix cache: a chunk is then computed by the same pass whether the chunks before it
    # were computed now or taken from a cache, so its keys and values are bitwise the same either way (a
    # backend whose big passes round differently at different widths needs this). None: every token row
    # gets the same numbers at any pass width and split (row-exact passes), so prompts may be read and
    # reused at any token.
    prefill_chunk: int | None = 512
    # With `prefill_chunk`, a chunk also ends right after these tokens (its chat template's turn start;
    # `prefill.Chunking`), so a conversation's next turn finds every chunk up to the last turn start.
    turn_start_ids: frozenset[int] = frozenset()
    # The cache's store can copy a row's keys and values out and write them back (`KVStore.gather` / `put`):
    # what a prefix cache needs.
    shares_prefixes: bool = False

    def same_layer_shapes(self, other: "CausalLM") -> bool:
        """Whether `other` can run on this model's cache (the same layers, key/value heads and head size)."""
        return False

    def new_cache(self, batch_size: int) -> ModelCache: ...

    def forward(self, tokens: torch.Tensor, cache: ModelCache, visible: torch.Tensor | None = None, last_only: bool = False,
                tree: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [batch, T] long; visible: [batch, T] bool (False = padding slot), default all True.
        tree: [batch, T, T] bool, for backends with `supports_trees`: the new tokens form a token tree,
        tree[b, t, j] when token j is t itself or an ancestor of t (so j <= t); each token then attends
        to the cache and its own ancestors only, at the position its path gives it.

        Appends T slots to `cache` and returns logits [batch, T, vocab_size] float32 (T = 1 with
        last_only), where logits[:, t] is the distribution of the token that follows tokens[:, t].
        Position ids come from `cache.slots.extend`: a token's position is the number of slots its
        row sees before it.
        """
        ...

    def extend(self, tokens: torch.Tensor, cache: ModelCache) -> None:
        """Appends tokens [batch, T] (no padding) to `cache`, computing only what the cache keeps: a prompt's
        read, whose outputs nobody reads (the prompt's last token opens the first decode step). The keys and
        values are bitwise those `forward` stores. This default is a forward pass whose logits are dropped; a
        backend may skip the work past the last layer's keys and values."""
        self.forward(tokens, cache, last_only=True)
