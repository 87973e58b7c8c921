"""Building the offload tier for an engine from its config, with every check done before any work.

`build_param_offload` returns the `ShardStore` that stage 3's parameter shards live in (None when
offload_param is off, or is `cpu` on a machine without a GPU, where host memory is the only memory);
`build_grad_offload` the one their gradient shards live in (fp32 with offload_param nvme only).
The optimizer's offload is built by the engine (engine/optimizer_offload.py), with `nvme_rank_dir` from here.
Before anything is created it checks, naming the key and the fix: nvme_path exists, is a writable directory
and has room for the predicted bytes.
Settings that cannot have an effect on this machine are reported once (a warning).
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch

from .. import comm
from ..config import ConfigError, ZeroConfig
from ..host_memory import map_large_buffers
from .placement import HOST, placement_of
from ..precision.policy import PrecisionPolicy
from ..config.offload import OffloadDevice, ignored_settings
from .file_io import FileIO
from .run_dir import OffloadPathError, RankDir, check_nvme_path, new_run_id, report_leftovers
from .shard_store import ShardStore

log = logging.getLogger("zerodp")

# The lines report_ignored has logged: once per process, as Python's warnings registry dedups, so a second engine
# does not repeat them. Not a setting (nothing reads it but the dedup), hence not part of the engines' Runtime.
_reported: set[str] = set()


def report_ignored(config: ZeroConfig, rank: int) -> None:
    """Warn once per process about offload settings without effect here."""
    zero = config.zero_optimization
    for line in ignored_settings(zero.offload_optimizer, zero.offload_param, config.aio, torch.cuda.is_available()):
        if rank == 0 and line not in _reported:
            _reported.add(line)
            warnings.warn(line, UserWarning, stacklevel=3)


def shared_run_id(process_group: comm.ProcessGroup) -> str:
    """Rank 0's fresh run id, on every rank (note: a collective)."""
    return comm.all_gather_object(new_run_id(), process_group)[0]


def build_param_offload(config: ZeroConfig, model_numel: int, itemsize: int, largest_numel: int,
                        process_group: comm.ProcessGroup, device: Optional[torch.device] = None):
    """The parameter-shard store of this rank (None when offload_param is off or changes nothing here).

    `model_numel` elements of `itemsize` bytes are sharded over the group; `largest_numel` is the
    largest parameter (a shard of it must fit one `buffer_size` I/O buffer, as in DeepSpeed). `device`:
    the model's; where its shards rest and whether they are pinned is the placement's answer for it
    (None, before any parameter exists (init_context): the GPU if there is one).
    """
    section = config.zero_optimization.offload_param
    rank = comm.get_rank(process_group)
    report_ignored(config, rank)
    if not section.enabled:
        return None
    map_large_buffers()  # freed shards and windows must leave RSS: [Note: freed memory that stays resident]
    world = comm.get_world_size(process_group)
    if section.buffer_size < -(-largest_numel // world):
        raise ConfigError(f"zero_optimization.offload_param.buffer_size={section.buffer_size} elements cannot hold "
                          f"a shard of the largest parameter ({largest_numel} elements over {world} ranks); set "
                          f"buffer_size to at least {-(-largest_numel // world)}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else HOST
    home = placement_of(config, device).param_shards
    if section.device is OffloadDevice.CPU:
        # a model on the CPU: its shards already live in host memory, nothing to move (said once by report_ignored)
        return ShardStore(None, None, section.max_in_cpu, section.buffer_count, home.pinned) \
            if home.device != device else None
    if section.max_in_cpu is None and rank == 0:
        log.info("zerodp offload_param: max_in_cpu is not set: at most %d shards of the largest size stay in memory "
                 "(buffer_count, the gathers' working set); set max_in_cpu to cache more", section.buffer_count)
    key = "zero_optimization.offload_param.nvme_path"
    needed = -(-model_numel // world) * itemsize * (1 if _grads_stay(config) else 2)
    rank_dir = nvme_rank_dir(section.nvme_path, key, needed, process_group)  # its own run folder
    io = FileIO(config.aio.io_requests, config.aio.block_size)
    return ShardStore(rank_dir, io, section.max_in_cpu, section.buffer_count, home.pinned)


def _grads_stay(config: ZeroConfig) -> bool:
    """Whether gradient shards stay in memory with offload_param nvme: in mixed precision they do (the
    step converts them to fp32 as a whole); in fp32 they go to the parameters' folder too."""
    return PrecisionPolicy.from_config(config).mixed


def build_grad_offload(config: ZeroConfig, param_home):
    """The store of stage 3's gradient shards ([Note: gradient shards offloaded] in shard_store.py): with
    offload_param nvme in fp32 training, in the parameter store's folder and I/O pool; otherwise None.
    `param_home`: the parameter shards' store (a `ShardStore`, or a `NullShardStore` when they stay)."""
    if param_home.rank_dir is None or _grads_stay(config):  # a null or host-memory parameter store: in memory
        return None
    section = config.zero_optimization.offload_param
    # no read-ahead: a gradient shard is first acquired zero (nothing to read) as its reduction lands,
    # and the step reads each once; the strategy plans only the parameter store's reads (end_step)
    return ShardStore(param_home.rank_dir, param_home.io, section.max_in_cpu, section.buffer_count,
                      kind="grad", owns_files=False, read_ahead=False)


def _ranks_on_this_disk(process_group: comm.ProcessGroup) -> int:
    """Ranks of this host (they share nvme_path's file system), for the up-front space check."""
    import socket

    hosts = comm.all_gather_object(socket.gethostname(), process_group)
    return hosts.count(socket.gethostname())


def nvme_rank_dir(nvme_path: str, key: str, needed_bytes: int, process_group: comm.ProcessGroup) -> RankDir:
    """This rank's folder under `nvme_path`, after every rank checked the path has room for `needed_bytes`.

    Every rank fails together (none waits in a later collective); rank 0 reports folders left by crashed runs.
    """
    error = None
    try:
        check_nvme_path(nvme_path, key, needed_bytes * _ranks_on_this_disk(process_group))
    except OffloadPathError as err:
        error = str(err)
    errors = comm.all_gather_object(error, process_group)
    if any(errors):
        raise ConfigError(next(e for e in errors if e))
    rank = comm.get_rank(process_group)
    if rank == 0:
        report_leftovers(nvme_path)
    return RankDir(nvme_path, shared_run_id(process_group), rank)
