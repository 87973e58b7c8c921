"""Where offloaded flat tensors live: host memory (`HostStore`) or one file per tensor (`FileStore`).

A store keeps named flat regions ("exp_avg", "exp_avg_sq", ...) of `numel` elements each, addressed by
element offset. Both stores answer the same calls, so the optimizer streams through one code path
whether the device is `cpu` or `nvme`:
  buffer(key, offset, numel, slot) -> the tensor a window is stepped in (host: a view of the store
                                       itself, zero copy; file: a slice of an I/O buffer `slot`)
  read(key, offset, out)           -> IOHandle (host: nothing to do)
  write(key, offset, src)          -> IOHandle (host: nothing to do when src is the store's own view)
Bytes are stored as they are; no dtype conversion happens anywhere.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .file_io import DONE, FileIO, IOHandle
from .run_dir import RankDir


class HostStore:
    """Flat tensors in host memory (`offload_optimizer.device: cpu`, and the resident part of `ratio`)."""

    is_host = True

    def __init__(self, numel: int, pin_memory: bool = False) -> None:
        self.numel = numel
        self.pin_memory = pin_memory
        self.regions: dict[str, torch.Tensor] = {}

    def ensure(self, key: str, dtype: torch.dtype) -> None:
        if key not in self.regions:
            self.regions[key] = torch.zeros(self.numel, dtype=dtype, pin_memory=self.pin_memory)
        assert self.regions[key].dtype == dtype, f"offloaded state {key!r} changed dtype"

    def buffer(self, key: str, offset: int, numel: int, slot: Optional[dict]) -> torch.Tensor:
        return self.regions[key][offset:offset + numel]

    def read(self, key: str, offset: int, out: torch.Tensor) -> IOHandle:
        region = self.regions[key][offset:offset + out.numel()]
        if region.data_ptr() != out.data_ptr():
            out.copy_(region)
        return DONE

    def write(self, key: str, offset: int, src: torch.Tensor) -> IOHandle:
        region = self.regions[key][offset:offset + src.numel()]
        if region.data_ptr() != src.data_ptr():
            region.copy_(src)
        return DONE

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.regions.values())

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self.regions.clear()


class FileStore:
    """One file per region under a `RankDir` (`device: nvme`), sized up front with posix_fallocate so that
    a full disk fails at creation, not in the middle of a step."""

    is_host = False

    def __init__(self, rank_dir: RankDir, numel: int, io: FileIO, prefix: str = "") -> None:
        self.rank_dir = rank_dir
        self.numel = numel
        self.io = io
        self.prefix = prefix
        self.fds: dict[str, int] = {}
        self.dtypes: dict[str, torch.dtype] = {}

    def ensure(self, key: str, dtype: torch.dtype) -> None:
        if key in self.fds:
            assert self.dtypes[key] == dtype, f"offloaded state {key!r} changed dtype"
            return
        path = self.rank_dir.path_of(f"{self.prefix}{key}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        nbytes = self.numel * dtype.itemsize
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as err:
                os.close(fd)
                raise OSError(f"cannot allocate {nbytes / 2**30:.2f} GiB for {path}: {err}; free disk space or set "
                              f"nvme_path to a larger disk") from err
        self.fds[key] = fd
        self.dtypes[key] = dtype

    def buffer(self, key: str, offset: int, numel: int, slot: Optional[dict]) -> torch.Tensor:
        return slot[key][:numel]

    def read(self, key: str, offset: int, out: torch.Tensor) -> IOHandle:
        return self.io.read(self.fds[key], offset * self.dtypes[key].itemsize, out)

    def write(self, key: str, offset: int, src: torch.Tensor) -> IOHandle:
        assert src.dtype == self.dtypes[key], "no dtype conversion: a region keeps the dtype it was created with"
        return self.io.write(self.fds[key], offset * self.dtypes[key].itemsize, src)

    def host_bytes(self) -> int:
        return 0

    def disk_bytes(self) -> int:
        return sum(self.numel * d.itemsize for d in self.dtypes.values())

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
