"""Measure offload I/O strategies on one directory: which way of writing and reading tensor bytes is fastest.

    .venv/bin/python bench/offload_io.py --path /tmp --mib 256

Compares, on the same file size and request size: zerodp's FileIO (buffered pread/pwrite from a
thread pool, 1/2/4 threads), O_DIRECT with page-aligned buffers (mmap) and 1 MiB requests, and `dd`
with oflag=direct/iflag=direct as the disk's reference. Reads are measured after posix_fadvise
DONTNEED, so buffered reads come from the disk where the kernel honours it (results in
bench/results/offload_io.txt). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from zerodp.offload.file_io import FileIO  # noqa: E402


def _drop(fd: int, nbytes: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)


def file_io(path: str, data: torch.Tensor, threads: int, block: int) -> tuple[float, float]:
    io = FileIO(threads, block)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    nbytes = data.numel() * data.element_size()
    os.posix_fallocate(fd, 0, nbytes)
    t = time.perf_counter()
    io.write(fd, 0, data).wait()
    os.fsync(fd)
    w = time.perf_counter() - t
    _drop(fd, nbytes)
    out = torch.empty_like(data)
    t = time.perf_counter()
    io.read(fd, 0, out).wait()
    r = time.perf_counter() - t
    assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))
    os.close(fd)
    io.close()
    return nbytes / w, nbytes / r


def direct_io(path: str, nbytes: int, block: int) -> tuple[float, float]:
    buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    t = time.perf_counter()
    for off in range(0, nbytes, block):
        os.pwritev(fd, [buf], off)
    os.fsync(fd)
    w = time.perf_counter() - t
    t = time.perf_counter()
    for off in range(0, nbytes, block):
        os.preadv(fd, [buf], off)
    r = time.perf_counter() - t
    os.close(fd)
    return nbytes / w, nbytes / r


def _dd(*args: str) -> str:
    return subprocess.run(["dd", *args], capture_output=True, text=True).stderr.strip().splitlines()[-1]


def dd(path: str, mib: int) -> list[tuple[str, str]]:
    """dd's write and read of the same size: direct I/O, and buffered with the data flushed before dd ends
    (conv=fdatasync), the way FileIO's write is timed here (its fsync is inside the time)."""
    w = _dd("if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync")
    r = _dd(f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct")
    wb = _dd("if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync")
    return [("dd oflag=direct conv=fsync", w), ("dd iflag=direct", r), ("dd buffered conv=fdatasync", wb)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4], help="FileIO thread counts to try")
    ap.add_argument("--block-mib", type=int, nargs="+", default=[1], help="FileIO request sizes (aio block_size)")
    ns = ap.parse_args()
    nbytes = ns.mib << 20
    data = torch.randn(nbytes // 4)
    target = os.path.join(ns.path, "zerodp-io-bench.bin")
    try:
        for threads in ns.threads:
            for block_mib in ns.block_mib:
                w, r = file_io(target, data, threads, block_mib << 20)
                print(f"FileIO buffered pread/pwrite, {threads} thread(s), {block_mib} MiB requests: write "
                      f"{w / 1e6:.0f} MB/s, read {r / 1e6:.0f} MB/s", flush=True)
        try:
            w, r = direct_io(target, nbytes, 1 << 20)
            print(f"O_DIRECT, aligned 1 MiB requests, 1 thread: write {w / 1e6:.0f} MB/s, read {r / 1e6:.0f} MB/s")
        except OSError as err:
            print(f"O_DIRECT not available on {ns.path}: {err}")
        for name, line in dd(target, ns.mib):
            print(f"{name}: {line}")
    finally:
        if os.path.exists(target):
            os.remove(target)


if __name__ == "__main__":
    main()
