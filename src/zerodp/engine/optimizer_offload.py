"""The optimizer-state offload of an engine (ZeRO-Offload / ZeRO-Infinity), built from its config.

`build_optimizer_offload` returns the `OffloadedOptimizerState` the sharded optimizer streams its state
through (None when offload_optimizer is off). Before anything is created it checks, naming the key and the
fix: the optimizer is elementwise (LAMB and LARC need whole-parameter norms over the full shard in one step),
and nvme_path has room for the predicted bytes (offload/tier.py's `nvme_rank_dir`). It lives with the
engine, not in offload/, because it asks the optimizer (optim/, optimizers/) what it needs: offload/ holds
the stores, the optimizer builds on them.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .. import comm
from ..config import ConfigError, ZeroConfig
from ..config.offload import DEFAULT_SUB_GROUP_SIZE, OffloadDevice
from ..host_memory import map_large_buffers
from ..offload.file_io import FileIO
from ..offload.optimizer_state import OffloadedOptimizerState
from ..offload.placement import Placement
from ..offload.store import FileStore, HostStore
from ..offload.tier import nvme_rank_dir, report_ignored
from ..optim.inner import SHARD_AWARE, state_numel_per_param
from ..optim.optimizer import OPTIMIZER_CHUNK_NUMEL
from ..optimizers.larc import LARC

log = logging.getLogger("zerodp")


def predicted_state_bytes(numel: int, user_optimizer) -> int:
    """Bytes of fp32 elementwise optimizer state for `numel` elements of this rank's shard."""
    return numel * 4 * state_numel_per_param(user_optimizer)


def build_optimizer_offload(config: ZeroConfig, units, user_optimizer, process_group: comm.ProcessGroup,
                            placement: Optional[Placement] = None):
    """The optimizer-state offload of this rank (None when offload_optimizer is off); see module docstring.
    `placement`: where the states live (their pinning); None: pinned where the config asks and a GPU exists."""
    zero = config.zero_optimization
    section = zero.offload_optimizer
    rank = comm.get_rank(process_group)
    report_ignored(config, rank)
    if not section.enabled:
        return None
    map_large_buffers()  # freed shards and windows must leave RSS: [Note: freed memory that stays resident]
    inner = user_optimizer.optim if isinstance(user_optimizer, LARC) else user_optimizer
    if isinstance(user_optimizer, LARC) or isinstance(inner, SHARD_AWARE):
        raise ConfigError(f"offload_optimizer streams the step in chunks, but {type(user_optimizer).__name__} "
                          f"needs whole-parameter norms over the full shard in one step; use an elementwise "
                          f"optimizer (Adam, AdamW, SGD, ...) or remove offload_optimizer")
    numel = sum(u.param_shard.numel() for u in units)
    sub_group_size = zero.sub_group_size
    if sub_group_size is None:
        sub_group_size = DEFAULT_SUB_GROUP_SIZE
        if rank == 0:
            log.info("zerodp offload_optimizer: sub_group_size is not set: the step streams windows of %d elements "
                     "(%d MiB per fp32 state tensor, %d buffers); set it to change", sub_group_size,
                     sub_group_size * 4 >> 20, section.buffer_count)
    # DeepSpeed reads sub_group_size 0 as the smallest groups (one tensor each): here, one optimizer chunk
    window = min(sub_group_size or OPTIMIZER_CHUNK_NUMEL, max(numel, 1))
    # cpu: all of it in host memory; nvme: the first (1 - ratio) in host memory, the rest in files
    host_fraction = 1.0 if section.device is OffloadDevice.CPU else 1.0 - section.ratio
    pin = placement.states.pinned if placement is not None else section.pin_memory and torch.cuda.is_available()
    rank_dir = None
    if section.device is OffloadDevice.NVME:
        key = "zero_optimization.offload_optimizer.nvme_path"
        needed = predicted_state_bytes(int(numel * section.ratio), user_optimizer)  # the files; windows are RAM
        rank_dir = nvme_rank_dir(section.nvme_path, key, needed, process_group)
    io = FileIO(config.aio.io_requests, config.aio.block_size)

    def make_stores(host_numel: int, file_numel: int):
        if section.device is OffloadDevice.CPU:
            return HostStore(host_numel, pin), None
        host = HostStore(host_numel, pin) if host_numel else None
        return host, FileStore(rank_dir, file_numel, io, prefix="optimizer.")

    owned = (io,) if rank_dir is None else (io, rank_dir)
    return OffloadedOptimizerState(window, section.buffer_count, make_stores,
                                   host_fraction, pin, owned)
