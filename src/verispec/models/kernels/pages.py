"""Where the kernels' weights live: on 2 MB pages (Linux transparent huge pages), asked for with madvise.

A decode step streams every weight once, and the step is as fast as that stream. On 4 KB pages the
stream crosses a page every 4 KB: the hardware prefetchers stop at each page boundary and every page
costs a TLB miss, so a core's loads have fewer bytes in flight than memory could serve. On 2 MB pages
the same bytes stream further ahead: the same numbers, a faster step (bench/README, "Weights on huge
pages").

Linux gives huge pages to anonymous memory that asks for them (`transparent_hugepage/enabled` set to
`madvise`, the common default) or to all of it (`always`); with `never`, or elsewhere, this is plain
memory. A matrix smaller than a huge page gains only if it shares one with its neighbours, so the
matrices are cut from slabs of `SLAB` bytes, 2 MB aligned, one after another; a bigger one gets its own.
A slab lives while any matrix cut from it does. `KernelConfig.huge_pages` (`VERISPEC_HUGE_PAGES=0`)
turns this off.
"""

from __future__ import annotations

import math
import mmap
import threading

import torch

from verispec.models.kernels import config as kernel_config

HUGE_PAGE = 2 << 20
SLAB = 64 << 20  # bytes a slab holds: the small matrices of a few layers
ALIGN = 64  # each matrix starts on a cache line


class _Slab:
    """An anonymous mapping of `size` bytes from a 2 MB boundary, advised to live on huge pages; `taken` of
    them handed out."""

    def __init__(self, size: int):
        # private (fd -1 makes it anonymous): a shared anonymous mapping is shmem, whose huge pages follow another
        # switch (shmem_enabled)
        self.mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        self.bytes = torch.frombuffer(self.mapping, dtype=torch.uint8)  # keeps the mapping alive
        self.start = -self.bytes.data_ptr() % HUGE_PAGE
        self.size, self.taken = size, 0
        try:  # before the first touch, so the first fault takes a huge page
            self.mapping.madvise(mmap.MADV_HUGEPAGE, self.start, size)
        except OSError:  # a kernel without transparent huge pages: plain pages
            pass

    def cut(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` from what is left, or None if they do not fit."""
        begin = -(-self.taken // ALIGN) * ALIGN
        if begin + nbytes > self.size:
            return None
        self.taken = begin + nbytes
        return self.bytes[self.start + begin : self.start + begin + nbytes]


_lock = threading.Lock()  # models may load on several threads (a server's)
_slab: _Slab | None = None  # the slab small matrices are cut from now


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised CPU tensor for weights the kernels stream, on huge pages where the system gives them."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # MADV_HUGEPAGE: Linux; elsewhere a slab would be plain memory cut small, so plain tensors
    if not kernel_config.current().huge_pages or nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    global _slab
    with _lock:
        if nbytes > SLAB // 4:
            memory = _Slab(-(-nbytes // HUGE_PAGE) * HUGE_PAGE).cut(nbytes)
        else:
            memory = _slab.cut(nbytes) if _slab is not None else None
            if memory is None:
                _slab = _Slab(SLAB)
                memory = _slab.cut(nbytes)
    return memory.view(dtype).view(shape)
