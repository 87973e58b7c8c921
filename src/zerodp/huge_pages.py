"""`advise_huge_pages`: ask Linux to back a large, fresh CPU buffer with 2 MiB pages before it is written.

[Note: huge pages for unit buffers] A stage-3 unit's gathered parameters, its per-round full gradient
and an offloaded shard read back are allocated, filled and freed every step. glibc maps each such buffer
on its own (offload/heap.py), so the first write of every 4 KiB faults a fresh zeroed page in. Measured
here: allocating and first copying 160 MB took 0.054 s, a second copy into the same memory 0.008 s; with
the buffer advised for transparent huge pages (MADV_HUGEPAGE, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`, as on most distributions) the
first copy took 0.013 s and the free 0.001 s instead of 0.010 s. On the 3e9 GPT's blocks that is whole
seconds per step (bench/results/big_offload_step.md). Only the 2 MiB-aligned interior of the buffer is
advised, so no page outside it is touched or counted in RSS; anywhere else (other systems, GPU tensors,
small buffers) this is a no-op, and a refused advice changes nothing but speed.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from .libc import libc_function

HUGE_PAGE_BYTES = 2 << 20
MIN_ADVISED_BYTES = 8 << 20   # below a few huge pages the saving is not worth a system call
_MADV_HUGEPAGE = 14           # linux/mman.h


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned interior of `tensor`'s storage for huge pages; call it before the first write.
    Returns whether the advice was given and accepted."""
    if tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes < MIN_ADVISED_BYTES or not sys.platform.startswith("linux"):
        return False
    madvise = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if madvise is None:
        return False
    start = storage.data_ptr()
    lo = (start + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    hi = (start + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return hi > lo and madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0
