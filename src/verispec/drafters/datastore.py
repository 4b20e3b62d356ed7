"""Retrieval drafting (REST, He et al. 2024): drafts from a large static corpus through a suffix array.

A datastore is text tokenized with the target's tokenizer, `tokens` [N] (documents joined by a separator
token), and its suffix array `order` [N]: the start of every suffix, sorted by its first `DEPTH` tokens. The
suffixes that begin with a pattern are then one contiguous stretch of `order`, found by binary search, and
the tokens that follow the pattern there are themselves sorted: the counts of each continuation are run
lengths, and narrowing to one of them is a sub-stretch. So a walk down the suffix tree of the whole corpus
needs no tree: the longest suffix of the context (of `min_match` to `max_match` tokens) that occurs, then the
most frequent next token while its share of the places stays above `min_token_prob`, as `SuffixDrafter` walks
the request's own text (`SuffixDrafter` asks a datastore where its own corpora match fewer than
`suffix.DATASTORE_BELOW` tokens, and drafts from it where it matches further).

REST drafts from The Stack on GPUs; this machine has no internet beyond PyPI, so the default corpus is what
ships with it: the Python sources of the installed packages (`datastore_for`), a few million tokens built in
seconds and cached on disk. Memory: 16 bytes a token (the tokens, the suffix array, and each suffix's first two
tokens as one key, which starts a search in C). A datastore is deterministic given the context: its drafts are
point masses, exact under every verifier.
"""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path
from typing import Iterable

import numpy as np

from verispec.corpus import site_packages_files
from verispec.errors import VerispecError

DEPTH = 32  # the suffix array orders suffixes by this many tokens: matches and walks go no deeper
PAD = -1  # past the corpus's end: sorts before every token, as a shorter suffix does


class Datastore:
    """A token corpus and its suffix array (see the module docstring). tokens, order: int32 arrays of one length."""

    def __init__(self, tokens: np.ndarray, order: np.ndarray):
        if tokens.shape != order.shape or tokens.ndim != 1:
            raise VerispecError(f"a datastore needs tokens and a suffix array of one length, got {tokens.shape} and {order.shape}")
        self.tokens = np.concatenate([np.asarray(tokens, dtype=np.int32), np.full(DEPTH, PAD, dtype=np.int32)])
        self.order = np.asarray(order, dtype=np.int32)
        # the first two tokens of each suffix, in suffix-array order: a pattern's stretch starts with a search in C
        first, second = self.tokens[self.order].astype(np.int64), self.tokens[self.order + 1].astype(np.int64)
        self._pairs = (first + 1) * (1 << 32) + (second + 1)

    def __len__(self) -> int:
        return len(self.order)

    @classmethod
    def build(cls, documents: Iterable[list[int]], separator: int, progress: bool = False) -> "Datastore":
        """A datastore of the documents (token lists), each followed by `separator`."""
        tokens = []
        for document in documents:
            tokens.extend(document)
            tokens.append(separator)
        tokens = np.asarray(tokens, dtype=np.int32)
        return cls(tokens, suffix_array(tokens, progress))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as f:
            np.savez(f, tokens=self.tokens[: len(self)], order=self.order)
        partial.replace(path)  # a complete file or none

    @classmethod
    def load(cls, path: str | Path) -> "Datastore":
        with np.load(path) as data:
            return cls(data["tokens"], data["order"])

    def stretch(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi): the positions of `order` whose suffixes begin with `pattern` (at least 2 tokens, at most DEPTH)."""
        key = (pattern[0] + 1) * (1 << 32) + (pattern[1] + 1)
        lo, hi = int(np.searchsorted(self._pairs, key, "left")), int(np.searchsorted(self._pairs, key, "right"))
        for j in range(2, len(pattern)):
            if hi <= lo:
                break
            column = self.tokens[self.order[lo:hi] + j]  # sorted: the stretch agrees on the first j tokens
            lo, hi = lo + int(np.searchsorted(column, pattern[j], "left")), lo + int(np.searchsorted(column, pattern[j], "right"))
        return lo, hi

    def walk(self, context: list[int], draft_len: int, min_match: int = 2, max_match: int = 12,
             min_token_prob: float = 0.1, max_spec_factor: float = 1.0) -> tuple[list[int], list[float], int]:
        """The draft after `context`: (tokens, confidence count(token) / (count(matched) + 1) each, the match's
        length), the most frequent continuation of its longest suffix found here (at least `min_match` tokens),
        going at most max_spec_factor * match tokens. No match: ([], [], 0)."""
        min_match = max(2, min_match)
        longest = min(max_match, len(context), DEPTH - 1)
        found = None
        low, high = min_match, longest  # the longest match by bisection: a suffix that occurs has every shorter one too
        while low <= high:
            length = (low + high) // 2
            lo, hi = self.stretch(context[len(context) - length :])
            if hi > lo:
                found, low = (length, lo, hi), length + 1
            else:
                high = length - 1
        if found is None:
            return [], [], 0
        match, lo, hi = found
        chain, probs = [], []
        for i in range(min(draft_len, int(max_spec_factor * match) or 1, DEPTH - match)):
            column = self.tokens[self.order[lo:hi] + match + i]  # sorted: continuations are runs
            values, starts, counts = np.unique(column, return_index=True, return_counts=True)
            valid = values != PAD
            if not valid.any():
                break
            best = int(np.argmax(np.where(valid, counts, -1)))
            if counts[best] / (hi - lo) < min_token_prob:
                break
            chain.append(int(values[best]))
            probs.append(float(counts[best]) / (hi - lo + 1))
            lo, hi = lo + int(starts[best]), lo + int(starts[best]) + int(counts[best])
        return chain, probs, match


def suffix_array(tokens: np.ndarray, progress: bool = False) -> np.ndarray:
    """The suffix array of `tokens` by their first DEPTH tokens (prefix doubling: each round ranks suffixes by twice
    as many tokens, from the ranks of the last; ties past DEPTH tokens keep text order)."""
    n = len(tokens)
    rank = tokens.astype(np.int64)
    span = 1
    started = time.perf_counter()
    while span < DEPTH:
        following = np.full(n, PAD, dtype=np.int64)
        if span < n:
            following[: n - span] = rank[span:]
        order = np.lexsort((following, rank))
        first, second = rank[order], following[order]
        new = np.ones(n, dtype=bool)
        new[1:] = (first[1:] != first[:-1]) | (second[1:] != second[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new) - 1
        span *= 2
        if progress:
            print(f"verispec: datastore suffix array, {n} tokens: ranked by {span} tokens "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    return np.argsort(rank, kind="stable").astype(np.int32)


def site_packages_documents(tokenizer, files: list[Path], max_tokens: int, seed: int = 0,
                            progress: bool = False) -> Iterable[list[int]]:
    """The installed packages' Python sources (`files`: `corpus.site_packages_files`, tests and vendored copies left
    out), in a fixed shuffled order, tokenized, until `max_tokens`; files over 200 kB (generated tables) are skipped."""
    from tqdm import tqdm

    files = list(files)
    random.Random(seed).shuffle(files)
    total = 0
    bar = tqdm(total=max_tokens, desc="datastore: tokenizing", unit="tok", disable=not progress)
    for path in files:
        try:
            if path.stat().st_size > 200_000:
                continue
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        ids = tokenizer.encode(text)
        yield ids
        total += len(ids) + 1
        bar.update(len(ids) + 1)
        if total >= max_tokens:
            break
    bar.close()


DEFAULT_TOKENS = 5_000_000  # ~20 MB of Python source: built in ~20 s here, 40 MB on disk


def datastore_for(target, max_tokens: int = DEFAULT_TOKENS, progress: bool = True) -> Datastore:
    """The default datastore of `target`: its tokenizer over the installed packages' Python sources, built on first
    use (with progress) and cached under the verispec home, keyed by the tokenizer, the size and the files."""
    from verispec import zoo

    if target.tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer: a datastore is text tokenized with the target's tokenizer")
    files = site_packages_files()
    fingerprint = hashlib.sha256(repr((target.name, target.vocab_size, max_tokens, len(files),
                                       [str(p) for p in files[:: max(1, len(files) // 256)]])).encode()).hexdigest()[:16]
    path = zoo.home() / "datastores" / f"{target.name}-{fingerprint}.npz"
    if path.exists():
        return Datastore.load(path)
    if progress:
        print(f"verispec: building a datastore of up to {max_tokens} tokens of installed Python sources for "
              f"{target.name} (once; cached in {path})", flush=True)
    started = time.perf_counter()
    separator = min(target.eos_token_ids) if target.eos_token_ids else 0
    store = Datastore.build(site_packages_documents(target.tokenizer, files, max_tokens, progress=progress), separator,
                            progress)
    store.save(path)
    if progress:
        print(f"verispec: datastore of {len(store)} tokens built in {time.perf_counter() - started:.0f} s", flush=True)
    return store
