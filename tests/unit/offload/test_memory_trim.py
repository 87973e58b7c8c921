"""host_memory.release_free_memory gives freed heap pages back to the kernel (glibc), which bounds stage 3's RSS growth."""

import psutil
import pytest

from zerodp.host_memory import release_free_memory


def test_release_free_memory_returns_freed_heap_pages():
    # Many mid-size blocks (below glibc's mmap threshold, so they live in the heap), then free all but
    # the last one: the freed pages stay in the process until trimmed.
    blocks = [bytearray(64 * 1024) for _ in range(2000)]  # 125 MiB
    keep = blocks[-1]
    del blocks
    before = psutil.Process().memory_info().rss
    if not release_free_memory():
        pytest.skip("not glibc: malloc_trim is unavailable, nothing to release")
    after = psutil.Process().memory_info().rss
    assert before - after > 50 * 2**20, f"RSS {before >> 20} -> {after >> 20} MiB"
    assert len(keep) == 64 * 1024
