"""advise_huge_pages: large fresh CPU buffers are backed by 2 MiB pages where Linux offers transparent huge
pages for advised memory ([Note: huge pages for unit buffers]); elsewhere it declines and changes nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from zerodp.host_memory import alloc_storage, free_storage
from zerodp.shard.flat.buffer import FlatBuffer
from zerodp.shard.flat.layout import FlatLayout
from zerodp.host_memory import HUGE_PAGE_BYTES, MIN_ADVISED_BYTES, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_for_advised_memory() -> bool:
    return sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_small_and_non_cpu_buffers_are_left_alone():
    assert not advise_huge_pages(torch.empty(MIN_ADVISED_BYTES // 4 - 1))
    assert not advise_huge_pages(torch.empty(MIN_ADVISED_BYTES, device="meta"))


@pytest.mark.skipif(not _thp_for_advised_memory(), reason="no transparent huge pages for advised memory here")
def test_a_unit_buffer_reattached_by_alloc_storage_is_backed_by_huge_pages():
    numel = 8 * HUGE_PAGE_BYTES // 4 + 12_345  # not a multiple of the page: only the aligned interior is advised
    layout = FlatLayout.of([(numel,)], num_shards=2)
    buffer = FlatBuffer(layout, torch.float32, torch.device("cpu"))
    free_storage(buffer.tensor)
    alloc_storage(buffer.tensor, layout.padded_numel)
    buffer.tensor.fill_(1.0)  # the first write faults the pages in
    assert _huge_kib_at(buffer.tensor.data_ptr() + 4 * HUGE_PAGE_BYTES) >= HUGE_PAGE_BYTES // 1024
    assert float(buffer.tensor.sum()) == layout.padded_numel  # values are untouched by the advice
