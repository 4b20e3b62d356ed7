"""Measured costs of a model: what a target forward of width w costs relative to width 1, and what
this process has seen its models cost (`BOOK`).

Speculative decoding pays off only if verifying k+1 tokens in one pass costs about one decode step;
on a CPU that is a property of the kernels, so it is measured, not assumed. Knows nothing about
drafters or acceptance: it times the model alone.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from typing import Callable

import torch

class CostBook:
    """What this process has measured of its models, kept across calls (a call's own policy starts afresh).

    - prompt prefill: seconds for a number of prompt tokens, recent samples per model;
    - a plain decode step of one sequence: recent seconds per target.
    Keyed weakly: a model that is dropped takes its entries along. Estimates are None until measured.
    """

    def __init__(self, window: int = 16):
        self.window = window
        self._prefill = weakref.WeakKeyDictionary()  # model -> deque of (tokens, seconds)
        self._step = weakref.WeakKeyDictionary()  # model -> deque of seconds

    def _samples(self, table, model) -> deque:
        if model not in table:
            table[model] = deque(maxlen=self.window)
        return table[model]

    def record_prefill(self, model, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._samples(self._prefill, model).append((tokens, seconds))

    def prefill_seconds(self, model, tokens: int) -> float | None:
        """Estimated seconds to prefill `tokens`: the median per-token rate of the samples within a factor of
        two of that length (the nearest length when none is), times `tokens`."""
        samples = self._prefill.get(model)
        if not samples or tokens <= 0:
            return None if not samples else 0.0
        near = [s / t for t, s in samples if tokens / 2 <= t <= tokens * 2]
        if not near:
            t, s = min(samples, key=lambda sample: abs(sample[0] - tokens))
            near = [s / t]
        return statistics.median(near) * tokens

    def record_step(self, model, seconds: float) -> None:
        self._samples(self._step, model).append(seconds)

    def step_seconds(self, model) -> float | None:
        samples = self._step.get(model)
        return statistics.median(samples) if samples else None


BOOK = CostBook()


CODE = '''def merge_sort(items):
    """Sort a list with merge sort and return a new list."""
    if len(items) <= 1:
        return list(items)
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged


class LRUCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
'''


def context_tokens(model, length: int = 200) -> list[int]:
    """~`length` token ids of Python code (repeated if the tokenizer makes fewer), or a fixed id ramp."""
    if model.tokenizer is None:
        return [(17 * i + 5) % model.vocab_size for i in range(length)]
    ids = model.tokenizer(CODE)["input_ids"]
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


@torch.inference_mode()
def measure_width_costs(model, widths: list[int], repeats: int = 5, context: int = 200,
                        clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Median seconds of one `model.forward` of w new tokens on a warm cache of `context` tokens.

    Each repeat runs every width once (round-robin, so slow phases of a shared machine hit all
    widths alike) and rolls the cache back afterwards, so every pass sees the same context.
    clock: wall time by default; `time.thread_time` counts only this thread's CPU time, which
    ignores time stolen by other processes but is only meaningful with torch.set_num_threads(1).
    Returns {width: median seconds}.
    """
    return measure_width_costs_interleaved([model], widths, repeats, context, clock)[0]


@torch.inference_mode()
def measure_width_costs_interleaved(models: list, widths: list[int], repeats: int = 5, context: int = 200,
                                    clock: Callable[[], float] = time.perf_counter) -> list[dict[int, float]]:
    """`measure_width_costs` for several models at once, interleaved pass by pass (fair ratios)."""
    caches, tails = [], []
    for model in models:
        ids = context_tokens(model, context + max(widths))
        cache = model.new_cache(1)
        model.forward(torch.tensor([ids[:context]]), cache, last_only=True)
        caches.append(cache)
        tails.append(torch.tensor([ids[context:]]))
    times = [{w: [] for w in widths} for _ in models]
    for repeat in range(repeats + 1):  # the first round warms allocators and kernel caches
        for w in widths:
            for m, model in enumerate(models):
                started = clock()
                model.forward(tails[m][:, :w], caches[m])
                elapsed = clock() - started
                caches[m].truncate(torch.tensor([context]))
                if repeat:
                    times[m][w].append(elapsed)
    return [{w: statistics.median(t) for w, t in per_model.items()} for per_model in times]


def plain_decode_tokens_per_second(model, new_tokens: int = 32, context: int = 200) -> float:
    """Tokens/s of plain greedy decoding (the engine with drafter='none'), prefill excluded."""
    import verispec

    result = verispec.generate(model, context_tokens(model, context), drafter="none", max_new_tokens=new_tokens)
    stats = result.stats
    return len(result.token_ids) / max(stats.total_seconds - stats.prefill_seconds, 1e-9)
