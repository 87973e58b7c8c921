"""Large buffers straight from the kernel while offload is on: `map_large_buffers`.

[Note: freed memory that stays resident] torch's CPU allocator mallocs and frees every tensor. glibc
serves a request of at least `M_MMAP_THRESHOLD` bytes with its own mapping, returned to the kernel by
free(); smaller ones come from its heaps, whose freed holes stay resident. The threshold is dynamic:
freeing a mapped chunk raises it to that chunk's size (up to 32 MiB), so after the first 16 MiB
buffer is freed every later buffer of up to 16 MiB lands on the heap. Offload builds and trains by
allocating, filling and freeing one unit-sized buffer after another (a parameter's init slice, the
unit's gathered buffer, its shard before it is written to its file, its zero gradient shard), and
the heap keeps the high-water mark of them all. Measured (bench/offload_init_rss.py, 2 ranks, fp32,
both offloads on nvme): on 201M parameters peak RSS growth per rank over build, initialize and 3
steps was 2.02-2.45 GiB, and 0.27 GiB with this setting (losses bitwise the same); at 67M, one
malloc_trim right after initialize took 0.57-0.72 GiB down to 0.03 (so it was not live memory).

Setting the threshold explicitly (mallopt) switches the dynamic raise off: every buffer of at least
LARGE_BUFFER_BYTES is its own mapping and goes back to the kernel when freed, so RSS follows the
live bytes. The cost is a page fault per 4 KiB when such a buffer is first written, paid only by
runs that asked for offload (they traded speed for memory), and cut by huge pages: zerodp advises its
own unit-sized buffers ([Note: huge pages for unit buffers] in zerodp/huge_pages.py), and torch backs its
own large tensors by them when the process starts with THP_MEM_ALLOC_ENABLE=1 (read once, at torch's
first allocation, so it cannot be set from here; the start-up log line says so). Process-wide; a no-op
off glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os

from ..libc import libc_function

log = logging.getLogger("zerodp")

LARGE_BUFFER_BYTES = 1 << 20   # 1 MiB: unit shards and I/O windows are larger; small activations are not
_M_MMAP_THRESHOLD = -3         # glibc's mallopt parameter number (malloc.h)

_applied = False


def map_large_buffers(threshold_bytes: int = LARGE_BUFFER_BYTES) -> bool:
    """Make glibc map every allocation of at least `threshold_bytes` on its own (see the module note).

    Idempotent; returns whether it is in effect (False off glibc)."""
    global _applied
    if _applied:
        return True
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None or mallopt(_M_MMAP_THRESHOLD, threshold_bytes) != 1:
        return False
    _applied = True
    log.info("zerodp offload: buffers of %d KiB or more are mapped on their own, so freed ones leave RSS "
             "(glibc M_MMAP_THRESHOLD; see zerodp/offload/heap.py)%s", threshold_bytes >> 10,
             "" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else
             "; THP_MEM_ALLOC_ENABLE=1 in the launch environment backs torch's own large tensors by huge pages "
             "too, which makes their first writes several times cheaper (zerodp/huge_pages.py)")
    return True
