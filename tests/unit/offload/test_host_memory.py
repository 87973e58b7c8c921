"""host_memory: the C library is looked up on first use, never at `import zerodp`, and the allocator setting
offload makes (mallopt) is undone by `restore_malloc_defaults`."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from zerodp import host_memory


@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_import_zerodp_runs_no_library_lookup():
    """ctypes.util.find_library runs a subprocess (ldconfig, gcc); zerodp must not run it at import. torch is
    imported first: PyPI's CUDA build of torch looks up libdl itself at import (cuda.pathfinder), which is
    torch's cost, not zerodp's."""
    probe = ("import ctypes.util, sys, torch\n"
             "calls = []\n"
             "real = ctypes.util.find_library\n"
             "ctypes.util.find_library = lambda name: calls.append(name) or real(name)\n"
             "import zerodp, zerodp.engine.zero_engine, zerodp.offload.tier, zerodp.offload.store\n"
             "print(calls)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _rss_after_freeing(nbytes: int, count: int) -> int:
    """RSS growth left behind by `count` freed buffers of `nbytes`, allocated interleaved with kept small ones."""
    before = psutil.Process().memory_info().rss
    kept, buffers = [], []
    for _ in range(count):
        buffers.append(bytearray(nbytes))
        kept.append(bytearray(1024))
    del buffers
    return psutil.Process().memory_info().rss - before


def test_map_large_buffers_is_undone_by_restore():
    if host_memory.libc_function("mallopt", ()) is None:
        pytest.skip("not glibc: no mallopt")
    assert host_memory.large_buffers_mapped() is None
    try:
        assert host_memory.map_large_buffers(1 << 20)
        assert host_memory.map_large_buffers() and host_memory.large_buffers_mapped() == 1 << 20  # idempotent
        # 2 MiB buffers are mapped on their own: freeing them gives their pages back at once
        assert _rss_after_freeing(2 << 20, 64) < 16 << 20
    finally:
        assert host_memory.restore_malloc_defaults()
    assert host_memory.large_buffers_mapped() is None
    assert not host_memory.restore_malloc_defaults()  # nothing left to undo
