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

import ctypes
import os
from typing import Optional

import torch

from ..host_memory import libc_function
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


_FALLOC_KEEP_SIZE_PUNCH_HOLE = 0x01 | 0x02  # linux/falloc.h: free the blocks, keep the file's size


class FileStore:
    """One file per region under a `RankDir` (`device: nvme`), sized up front with posix_fallocate so that
    a full disk fails at creation, not in the middle of a step. A store whose values are all zeros may give
    its blocks back (`release`) and take them again before it is next written (`reserve`): the gradient
    shards' files hold no disk between an optimizer step and the next backward ([Note: gradient shards
    offloaded] in shard_store.py)."""

    is_host = False

    def __init__(self, rank_dir: RankDir, numel: int, io: FileIO, prefix: str = "") -> None:
        self.rank_dir = rank_dir
        self.numel = numel
        self.io = io
        self.prefix = prefix
        self.fds: dict[str, int] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.reserved = True   # every region's bytes are allocated on disk

    def ensure(self, key: str, dtype: torch.dtype, reserve: bool = True) -> None:
        """Create region `key`; `reserve=False`: as a sparse file, to be `reserve`d before its first write."""
        if key in self.fds:
            assert self.dtypes[key] == dtype, f"offloaded state {key!r} changed dtype"
            return
        path = self.rank_dir.path_of(f"{self.prefix}{key}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.fds[key] = fd
        self.dtypes[key] = dtype
        if not reserve:
            os.ftruncate(fd, self.numel * dtype.itemsize)
            self.reserved = False
            return
        try:
            self._allocate(key)
        except OSError:
            os.close(self.fds.pop(key))
            del self.dtypes[key]
            raise

    def _allocate(self, key: str) -> None:
        nbytes = self.numel * self.dtypes[key].itemsize
        if nbytes:
            try:
                os.posix_fallocate(self.fds[key], 0, nbytes)
            except OSError as err:
                raise OSError(f"cannot allocate {nbytes / 2**30:.2f} GiB for "
                              f"{self.rank_dir.path_of(self.prefix + key + '.bin')}: {err}; free disk space or set "
                              f"nvme_path to a larger disk") from err

    def release(self) -> None:
        """The values are zeros and will be written before they are read: give the disk blocks back."""
        fallocate = libc_function("fallocate", (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)) \
            if self.reserved else None
        if fallocate is None:  # then nothing is released
            return
        for key, fd in self.fds.items():
            nbytes = self.numel * self.dtypes[key].itemsize
            if nbytes and fallocate(fd, _FALLOC_KEEP_SIZE_PUNCH_HOLE, 0, nbytes) != 0:
                return  # the file system cannot punch holes: the blocks stay, nothing else changes
        self.reserved = False

    def reserve(self) -> None:
        """Allocate the blocks `release` gave back (or a sparse `ensure` never took); OSError if the disk is full."""
        if not self.reserved:
            for key in self.fds:
                self._allocate(key)
            self.reserved = True

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


def reserve_files(stores: list[FileStore], what: str) -> None:
    """`reserve` every store that released its blocks; on a full disk, one error naming the space and the fix."""
    released = [store for store in stores if not store.reserved]
    try:
        for store in released:
            store.reserve()
    except OSError as err:
        need = sum(store.disk_bytes() for store in released if not store.reserved) / 2**30
        raise OSError(f"zerodp offload: the {what}' files need {need:.2f} GiB more under {released[0].rank_dir.path} "
                      f"before this backward ({err}); files written there since the last step (a checkpoint?) "
                      f"took it: free disk space, or set nvme_path to a larger disk") from err
