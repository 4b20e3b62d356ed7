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

from verispec.models.kernels.threads import torch_on_one_thread


class CostBook:
    """What this process has measured of its models, kept across calls (a call's own policy starts afresh):

    - the seconds of a plain decode step of one sequence, per target;
    - what a draft model's prompt prefill costs relative to its target's prefill of the same prompt, by
      prompt length (the draft repeats the target's prefill on a smaller model, so the target's time for
      this very prompt, measured just before, prices the draft's better than a per-token rate would);
    - how many tokens the latest answers had, per target (what the workload asks for: short answers make
      a draft's prefill dear).
    Keyed weakly: a model that is dropped takes its entries along. Estimates are None until measured.
    """

    def __init__(self, window: int = 16, answers: int = 64):
        self.window = window
        self._step = weakref.WeakKeyDictionary()  # target -> deque of seconds
        self._relative = weakref.WeakKeyDictionary()  # target -> WeakKeyDictionary(draft -> deque of (tokens, ratio))
        self._answers = weakref.WeakKeyDictionary()  # target -> deque of answer lengths
        self.answer_window = answers

    def record_step(self, target, seconds: float) -> None:
        self._step.setdefault(target, deque(maxlen=self.window)).append(seconds)

    def step_seconds(self, target) -> float | None:
        samples = self._step.get(target)
        return statistics.median(samples) if samples else None

    def record_answer(self, target, tokens: int) -> None:
        self._answers.setdefault(target, deque(maxlen=self.answer_window)).append(tokens)

    def answers(self, target) -> list[int]:
        """The token counts of the latest answers `target` finished (at most `answer_window`)."""
        return list(self._answers.get(target, ()))

    def record_relative_prefill(self, target, draft, tokens: int, ratio: float) -> None:
        if tokens <= 0:
            return
        pairs = self._relative.setdefault(target, weakref.WeakKeyDictionary())
        pairs.setdefault(draft, deque(maxlen=self.window)).append((tokens, ratio))

    def relative_prefill(self, target, draft, tokens: int) -> float | None:
        """Draft prefill seconds per target prefill second for a prompt of `tokens`: the median ratio of the
        samples within a factor of two of that length, else the nearest length's."""
        samples = self._relative.get(target, {}).get(draft)
        if not samples:
            return None
        near = [r for t, r in samples if tokens / 2 <= t <= tokens * 2]
        return statistics.median(near) if near else min(samples, key=lambda sample: abs(sample[0] - tokens))[1]


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
    """`measure_width_costs` for several models at once, interleaved pass by pass (fair ratios).

    Passes are timed as the engine runs them, inside `torch_on_one_thread`: outside it, the PyTorch ops between
    passes (the cache's rollback) left OpenMP workers spinning on the kernels' cores, and a pass timed after them
    took up to ~1.2x its time in a decode step (the q8 1.5B's width-1 step 45 ms against 37, AMD EPYC, 2 threads)."""
    with torch_on_one_thread():
        return _interleaved(models, widths, repeats, context, clock)


def _interleaved(models: list, widths: list[int], repeats: int, context: int, clock: Callable[[], float]) -> list[dict[int, float]]:
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
