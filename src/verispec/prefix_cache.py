"""An exact prefix cache: keys and values of prompt prefixes already read, kept by token prefix and reused.

The next turn of a conversation, or a second request with the same system prompt, starts with tokens an
earlier request has read. Their keys and values are kept here in *blocks* of consecutive token positions,
each keyed by a hash chain over the token ids of every block up to it (vLLM's automatic prefix caching),
so a block is found only under the very prefix it was computed after.

A hit must give the keys and values a fresh read would compute, bit for bit, or a request would answer
differently with and without it. That holds by construction: a model whose passes round a row
differently at different pass widths reads every prompt in chunks fixed by its tokens alone
(`prefill.Chunking`: at most `CausalLM.prefill_chunk` tokens, and ending after each chat-turn start), and
the blocks here are those chunks, so a cached chunk is the output of the very pass a fresh read would
run. Keys and values written by decode steps, or by a tail chunk the prompt's end cut (another pass
width), are never stored for such a model. A model whose passes give every row the same numbers at any
width and split (`prefill_chunk` None: numerics="q8") may reuse a prefix at any token: blocks are
`GRANULAR_BLOCK` tokens, a prompt's partial tail block is stored too, and a lookup ends inside a stored
block where the tokens part.

A `salt` roots a request's hash chain apart (vLLM's `cache_salt`): requests of different salts share no
block, so one tenant cannot learn by timing whether another sent a prompt.

The store is bounded in bytes (the tensors' own sizes) and evicts the least recently used blocks first,
a block's descendants before it. It knows nothing about requests or scheduling; the tensors are read
and written through `KVStore.gather` / `put`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from verispec.models.base import CausalLM, ModelCache
from verispec.prefill import Chunking

GRANULAR_BLOCK = 16  # tokens per block where any split is exact (`CausalLM.prefill_chunk` None)


@dataclass
class _Block:
    parent: bytes  # the key of the block before it (the root key for the first)
    tokens: tuple[int, ...]  # its token ids (a chunk's; GRANULAR_BLOCK of them or fewer in a granular cache)
    keys: torch.Tensor  # [layers, kv_heads, len(tokens), head_dim]
    values: torch.Tensor  # the same shape

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class PrefixCache:
    """Blocks of keys/values by token prefix, at most `capacity_bytes` of tensors, least recently used out first.

    Blocks are the chunks of `chunking` (`prefill.Chunking`), or with chunking None (granular) runs of
    `GRANULAR_BLOCK` tokens, where a lookup may end inside a block and a partial tail is stored too. One
    cache serves one model's numbers: `namespace` (its name and numerics) roots every hash chain.
    Counters for /metrics: `queries` (prompt tokens looked up), `hits` (of them, tokens found), `evicted`
    (blocks dropped for room). Used from one thread (the server's worker)."""

    def __init__(self, capacity_bytes: int, chunking: Chunking | None, namespace: str = ""):
        if capacity_bytes <= 0 or (chunking is not None and chunking.cap <= 0):
            raise ValueError("a prefix cache needs a positive capacity and block size")
        self.capacity_bytes = int(capacity_bytes)
        self.chunking = chunking
        self.granular = chunking is None  # a lookup may end inside a block, and partial tail blocks are stored
        self.block_tokens = GRANULAR_BLOCK if chunking is None else chunking.cap  # the most tokens in a block
        self.namespace = namespace
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._children: dict[bytes, set[bytes]] = {}
        self.bytes = 0
        self.queries = self.hits = self.evicted = 0

    @classmethod
    def for_model(cls, model: CausalLM, capacity_bytes: int) -> "PrefixCache | None":
        """A cache shaped for `model`'s prefill (`prefill.Chunking.of`), or None if capacity_bytes is 0
        or the model's cache cannot hand out its keys and values (`CausalLM.shares_prefixes`)."""
        if capacity_bytes <= 0 or not model.shares_prefixes:
            return None
        return cls(capacity_bytes, Chunking.of(model), namespace=f"{model.name}/{getattr(model, 'numerics', '')}")

    def __len__(self) -> int:
        return len(self._blocks)

    def _root(self, salt: str) -> bytes:
        """The hash chain's start: the model's namespace, and the request's salt (none: the shared chain)."""
        return hashlib.blake2b(f"{self.namespace}\0{salt}".encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def _key(self, parent: bytes, tokens: tuple[int, ...]) -> bytes:
        return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()

    def _chain(self, tokens: list[int], salt: str) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, tokens) of each block of `tokens`: the chunks `Chunking.ends` fixes, or in a granular cache
        the whole `GRANULAR_BLOCK` runs and the partial tail."""
        if self.granular:
            ends = list(range(GRANULAR_BLOCK, len(tokens) + 1, GRANULAR_BLOCK))
            if len(tokens) % GRANULAR_BLOCK:
                ends.append(len(tokens))
        else:
            ends = self.chunking.ends(tokens)
        chain, parent, begin = [], self._root(salt), 0
        for end in ends:
            block = tuple(tokens[begin:end])
            parent = self._key(parent, block)
            chain.append((parent, block))
            begin = end
        return chain

    def lookup(self, tokens: list[int], salt: str = "") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The stored keys and values of the longest stored prefix of `tokens` under `salt`: a list of (keys,
        values) pieces [layers, kv_heads, n, head_dim] in position order (empty on a miss). Counts the query."""
        self.queries += len(tokens)
        pieces, used, parent, found = [], [], self._root(salt), 0
        for key, block in self._chain(tokens, salt):
            stored = self._blocks.get(key)
            if stored is None or stored.tokens != block or (self.granular and len(block) < GRANULAR_BLOCK):
                break
            pieces.append((stored.keys, stored.values))
            used.append(key)
            parent = key
            found += len(block)
        if self.granular and found < len(tokens):
            # where the chain of whole blocks ends, a stored block (whole or a tail) that starts like the rest
            rest = tokens[found : found + GRANULAR_BLOCK]
            best, best_key = 0, None
            for key in self._children.get(parent, ()):
                stored = self._blocks[key]
                common = next((i for i, (a, b) in enumerate(zip(stored.tokens, rest)) if a != b), min(len(stored.tokens), len(rest)))
                if common > best:
                    best, best_key = common, key
            if best_key is not None:
                stored = self._blocks[best_key]
                pieces.append((stored.keys[:, :, :best], stored.values[:, :, :best]))
                used.append(best_key)
                found += best
        for key in reversed(used):  # the deepest block least recent: evicted before the blocks it extends
            self._blocks.move_to_end(key)
        self.hits += found
        return pieces

    def load(self, tokens: list[int], cache: ModelCache, salt: str = "") -> int:
        """Look `tokens` up under `salt` and write the prefix found into `cache`, an empty one-row cache.
        Returns how many tokens it holds now."""
        start = 0
        for keys, values in self.lookup(tokens, salt):
            cache.store.put(start, keys, values)
            start += keys.shape[2]
        if start:
            cache.slots.extend(torch.ones(1, start, dtype=torch.bool, device=cache.slots.device))
        return start

    def insert(self, tokens: list[int], cache: ModelCache, row: int = 0, slots: torch.Tensor | None = None,
               salt: str = "") -> None:
        """Store under `salt` the blocks of `tokens` not stored yet, reading their keys and values from
        `cache`'s row `row`, where token i sits at slot slots[i] (default: slot i). The chunks
        `Chunking.ends` fixes only (a tail past the last end is left out), and in a granular cache the
        partial tail too: the caller hands only tokens whose keys and values are what a fresh read of that
        prefix computes."""
        parent, used, begin = self._root(salt), [], 0
        for key, block in self._chain(tokens, salt):
            used.append(key)
            if key in self._blocks:
                parent, begin = key, begin + len(block)
                continue
            where = torch.arange(begin, begin + len(block)) if slots is None else slots[begin : begin + len(block)]
            keys, values = cache.store.gather(row, where)
            stored = _Block(parent, block, keys, values)
            if stored.nbytes > self.capacity_bytes:
                used.pop()
                break
            self._blocks[key] = stored
            self._children.setdefault(parent, set()).add(key)
            self.bytes += stored.nbytes
            parent, begin = key, begin + len(block)
        for key in reversed(used):  # as in lookup: a chain's deepest block is the least recent
            self._blocks.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        while self.bytes > self.capacity_bytes and self._blocks:
            key, block = self._blocks.popitem(last=False)
            self.bytes -= block.nbytes
            self.evicted += 1
            siblings = self._children.get(block.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[block.parent]
            self._drop_descendants(key)

    def _drop_descendants(self, key: bytes) -> None:
        """Blocks under an evicted one can no longer be reached: free them too."""
        for child in self._children.pop(key, ()):
            block = self._blocks.pop(child, None)
            if block is not None:
                self.bytes -= block.nbytes
                self.evicted += 1
            self._drop_descendants(child)

    def clear(self) -> None:
        self._blocks.clear()
        self._children.clear()
        self.bytes = 0
