"""The contract between the engine and a model backend.

A backend turns new tokens into logits while appending them to a `ModelCache`; the engine rolls the
cache back with `cache.slots.truncate`. Backends know nothing about drafting or verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from verispec.cache import SlotCache


@dataclass
class ModelCache:
    """A backend's key/value store plus the slot bookkeeping the engine uses for rollback."""

    slots: SlotCache
    store: Any = None  # backend-owned (e.g. a transformers DynamicCache)

    def select(self, rows: list[int]) -> None:
        self.slots.select(rows)


class CausalLM(Protocol):
    """What the engine needs from a target or draft model."""

    vocab_size: int  # logits width
    max_context: int  # positions the model supports
    eos_token_ids: frozenset[int]
    tokenizer: Any  # a transformers tokenizer, or None for token-id-only use
    device: torch.device
    name: str

    def new_cache(self, batch_size: int) -> ModelCache: ...

    def forward(self, tokens: torch.Tensor, cache: ModelCache, visible: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """tokens: [batch, T] long; visible: [batch, T] bool (False = padding slot), default all True.

        Appends T slots to `cache` and returns logits [batch, T, vocab_size] float32 (T = 1 with
        last_only), where logits[:, t] is the distribution of the token that follows tokens[:, t].
        """
        ...
