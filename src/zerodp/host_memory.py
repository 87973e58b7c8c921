"""Host memory: what zerodp asks of the C library and the kernel about the CPU memory it allocates.

Four calls Python does not offer, each through one cached ctypes lookup (`libc_function`; the library
is found on the first call, never at import: ctypes.util.find_library runs a subprocess):
- `advise_huge_pages` (madvise): back a large, fresh unit buffer with 2 MiB pages;
- `release_free_memory` (malloc_trim): give freed heap pages back to the kernel (stage 3, every few steps);
- `map_large_buffers` (mallopt): while offload is on, map every large buffer on its own so a freed one
  leaves RSS; `restore_malloc_defaults` undoes it (the Runtime calls it when its last engine closes);
- fallocate's hole punching, looked up by offload/store.py through `libc_function`.
Everywhere else (other systems, GPU tensors) these are no-ops and change nothing but speed or RSS.

[Note: huge pages for unit buffers] A stage-3 unit's gathered parameters, its per-round full gradient
and an offloaded shard read back are allocated, filled and freed every step. glibc maps each such buffer
on its own (see [Note: freed memory that stays resident]), so the first write of every 4 KiB faults a fresh
zeroed page in. Measured here: allocating and first copying 160 MB took 0.054 s, a second copy into the same
memory 0.008 s; with the buffer advised for transparent huge pages (MADV_HUGEPAGE, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`, as on most distributions) the first
copy took 0.013 s and the free 0.001 s instead of 0.010 s. On the 3e9 GPT's blocks that is whole seconds per
step (bench/results/big_offload_step.md). Only the 2 MiB-aligned interior of the buffer is advised, so no
page outside it is touched or counted in RSS; a refused advice changes nothing but speed.

[Note: heap trimming] torch's CPU allocator has no cache: each buffer is malloc'ed and free'd. Stage 3 frees
and re-allocates every unit's gathered parameters and full gradients twice per step, interleaved with
activations of other sizes, and glibc keeps the holes this leaves in its heaps: RSS grows step after step
although the live bytes do not (measured on the 33.7M-parameter benchmark GPT at stage 3: +15 MiB of RSS per
step, 1,177 MiB after 16 steps, with 582 MiB live). `malloc_trim(0)` returns every free page to the kernel;
after each step it holds RSS at 645 MiB, but the next step then page-faults all its buffers in afresh
(80,000 minor faults per step). Trimming every TRIM_INTERVAL_STEPS steps bounds the growth at a small
fraction of that cost.

[Note: freed memory that stays resident] glibc serves a request of at least `M_MMAP_THRESHOLD` bytes with
its own mapping, returned to the kernel by free(); smaller ones come from its heaps, whose freed holes stay
resident. The threshold is dynamic: freeing a mapped chunk raises it to that chunk's size (up to 32 MiB),
so after the first 16 MiB buffer is freed every later buffer of up to 16 MiB lands on the heap. Offload
builds and trains by allocating, filling and freeing one unit-sized buffer after another (a parameter's
init slice, the unit's gathered buffer, its shard before it is written to its file, its zero gradient
shard), and the heap keeps the high-water mark of them all. Measured (bench/offload_init_rss.py, 2 ranks,
fp32, both offloads on nvme): on 201M parameters peak RSS growth per rank over build, initialize and 3 steps
was 2.02-2.45 GiB, and 0.27 GiB with this setting (losses bitwise the same); at 67M, one malloc_trim right
after initialize took 0.57-0.72 GiB down to 0.03 (so it was not live memory).
Setting the threshold explicitly (mallopt) switches the dynamic raise off: every buffer of at least
LARGE_BUFFER_BYTES is its own mapping and goes back to the kernel when freed, so RSS follows the live bytes.
The cost is a page fault per 4 KiB when such a buffer is first written, paid only by runs that asked for
offload (they traded speed for memory), and cut by huge pages (above); torch backs its own large tensors by
them when the process starts with THP_MEM_ALLOC_ENABLE=1 (read once, at torch's first allocation, so it
cannot be set from here; the start-up log line says so). The setting is process-wide: the Runtime
(zerodp/engine/runtime.py) restores glibc's default threshold when the last engine closes. glibc has no call that
turns the dynamic raise back on, so "restored" means the default's value, 128 KiB, held fixed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from typing import Callable, Optional

import torch

log = logging.getLogger("zerodp")

HUGE_PAGE_BYTES = 2 << 20
MIN_ADVISED_BYTES = 8 << 20   # below a few huge pages the saving is not worth a system call
_MADV_HUGEPAGE = 14           # linux/mman.h

TRIM_INTERVAL_STEPS = 8

LARGE_BUFFER_BYTES = 1 << 20          # 1 MiB: unit shards and I/O windows are larger; small activations are not
DEFAULT_MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's starting M_MMAP_THRESHOLD (malloc.h: DEFAULT_MMAP_THRESHOLD_MIN)
_M_MMAP_THRESHOLD = -3                # glibc's mallopt parameter number (malloc.h)


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def libc_function(name: str, argtypes: tuple, restype=ctypes.c_int) -> Optional[Callable]:
    """libc's `name` with its argument and result types set, or None where there is no such function
    (cached: hot paths such as advise_huge_pages call it per buffer)."""
    fn = getattr(_libc(), name, None)
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned interior of `tensor`'s storage for huge pages; call it before the first write.
    Returns whether the advice was given and accepted ([Note: huge pages for unit buffers])."""
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


def release_free_memory() -> bool:
    """Return malloc's free pages to the kernel ([Note: heap trimming]); False where the C library has no
    malloc_trim."""
    trim = libc_function("malloc_trim", (ctypes.c_size_t,))
    if trim is None:
        return False
    trim(0)
    return True


# Whether map_large_buffers is in effect: process state of the C library, mirrored here because glibc
# cannot be asked for its threshold. Changed only by the two functions below. A module global on purpose, not a
# field of the engine's Runtime: it mirrors the C library's one setting per process (two objects could not hold
# two values of it), and this leaf module is below every package; the Runtime's last lease out restores it.
_mapped_threshold: Optional[int] = None


def _set_mmap_threshold(threshold_bytes: int) -> bool:
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1


def map_large_buffers(threshold_bytes: int = LARGE_BUFFER_BYTES) -> bool:
    """Make glibc map every allocation of at least `threshold_bytes` on its own
    ([Note: freed memory that stays resident]). Idempotent; returns whether it is in effect (False off glibc)."""
    global _mapped_threshold
    if _mapped_threshold is not None:
        return True
    if not _set_mmap_threshold(threshold_bytes):
        return False
    _mapped_threshold = threshold_bytes
    log.info("zerodp offload: buffers of %d KiB or more are mapped on their own, so freed ones leave RSS "
             "(glibc M_MMAP_THRESHOLD; see zerodp/host_memory.py)%s", threshold_bytes >> 10,
             "" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else
             "; THP_MEM_ALLOC_ENABLE=1 in the launch environment backs torch's own large tensors by huge pages "
             "too, which makes their first writes several times cheaper (zerodp/host_memory.py)")
    return True


def large_buffers_mapped() -> Optional[int]:
    """The threshold `map_large_buffers` set, or None while glibc's own setting is in effect."""
    return _mapped_threshold


def restore_malloc_defaults() -> bool:
    """Undo `map_large_buffers`: glibc's default threshold again (see the module note for what glibc cannot
    undo). Returns whether anything was restored."""
    global _mapped_threshold
    if _mapped_threshold is None:
        return False
    _set_mmap_threshold(DEFAULT_MMAP_THRESHOLD_BYTES)
    _mapped_threshold = None
    return True


# [Note: freeing storage]
# `tensor = None` or `param.data = empty` only drops one reference: autograd may still hold the
# storage (saved tensors, views handed out earlier) and the bytes stay allocated. Resizing the
# untyped storage to 0 releases the bytes immediately while every view keeps its metadata, and
# resizing it back re-attaches fresh memory under the same views. A view read while its storage is
# freed raises an error rather than returning stale values.


def free_storage(tensor: torch.Tensor) -> None:
    """Release the bytes behind `tensor` (and all its views), keeping the tensor object usable later."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor, numel: int) -> None:
    """Re-attach memory of `numel` elements behind a tensor whose storage was freed (contents undefined);
    large CPU buffers are backed by huge pages where the system allows ([Note: huge pages for unit buffers])."""
    storage = tensor.untyped_storage()
    nbytes = numel * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)
        advise_huge_pages(tensor)


def is_storage_freed(tensor: torch.Tensor) -> bool:
    """True when the tensor's storage has been released by `free_storage`."""
    return tensor.untyped_storage().size() == 0
