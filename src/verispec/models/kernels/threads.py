"""How many threads the C kernels run on, and keeping PyTorch's own small ops off the cores they use.

The kernels' pool takes PyTorch's thread count (`threads()`). Inside `torch_on_one_thread()`, the scope
of a decode step, PyTorch's ops run on one thread while the kernels keep the count PyTorch had.

Why: a decode step is one wide C pass between a handful of PyTorch ops on the logits (an argmax over a
152k vocabulary, the verifier's softmaxes), each big enough for an OpenMP parallel region. libgomp's
workers busy-wait after a region, so the next C pass shared the two cores with a spinning thread: on
Qwen2.5-Coder-1.5B q8 (2 Zen 5 cores) the layers of a width-1 step took ~26-27 ms after such ops
against ~25 ms without, and ~30-32 ms when a head's taps added more of them; on a machine shared with
busy processes an OpenMP barrier also waits for descheduled threads. Those ops are small: one thread
does them in microseconds. Wide PyTorch work inside the scope (a float32 prefill's GEMMs, a
transformers model's pass) takes the threads back with `torch_threads()`.

PyTorch's thread count (OpenMP's) belongs to the calling thread, and so does the kernels' count a scope sets,
so scopes on two threads (a server's worker stepping while another thread decodes) cannot leave each other's
count behind: with one global, a scope entered inside another thread's and left after it restored the other's
count, and every later pass of the process ran its kernels on one thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class _Scope(threading.local):
    kernels: int | None = None  # inside torch_on_one_thread, on this thread: the kernels' count


_scope = _Scope()


def threads() -> int:
    """The number of threads the C kernels' pool runs a call on."""
    return _scope.kernels if _scope.kernels is not None else torch.get_num_threads()


@contextmanager
def torch_on_one_thread(kernel_threads: int | None = None) -> Iterator[None]:
    """PyTorch's ops on one thread for the duration; the kernels on `kernel_threads` (default: the count
    PyTorch had). Nested scopes keep the outer one's kernel count unless they name their own."""
    outer_kernels, outer_torch = _scope.kernels, torch.get_num_threads()
    _scope.kernels = kernel_threads if kernel_threads is not None else threads()
    if outer_torch != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if outer_torch != 1:
            torch.set_num_threads(outer_torch)
        _scope.kernels = outer_kernels


@contextmanager
def torch_threads() -> Iterator[None]:
    """Inside `torch_on_one_thread`, PyTorch's threads back (as many as the kernels run on) for wide
    PyTorch work; elsewhere nothing changes."""
    outer = _scope.kernels
    if outer is None or torch.get_num_threads() == outer:
        yield
        return
    inner = torch.get_num_threads()
    torch.set_num_threads(outer)
    _scope.kernels = None  # the kernels follow PyTorch's count again
    try:
        yield
    finally:
        _scope.kernels = outer
        torch.set_num_threads(inner)
