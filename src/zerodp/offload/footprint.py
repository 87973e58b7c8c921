"""The bytes an offload tier holds, per rank: host memory and disk, as arithmetic (the offload tiers' sizes by
design). The engine's report compares its measurement against it; `zerodp estimate --offload` tabulates it.

zerodp keeps the fp32 master with the parameters (in fp32 it *is* the parameter shard) and offloads
the elementwise optimizer state (Adam: 8 bytes per element). With Ψ_r = this rank's optimizer shard
(Ψ/N at stages 1-3), S = state bytes per element, W = window elements (min(sub_group_size, Ψ_r)),
B = buffer_count:
    cpu:   host = S Ψ_r                                    (no GPU: host memory is the device memory)
    nvme:  disk = S Ψ_r ratio,  host = S Ψ_r (1 - ratio) + B W S   (the I/O slots: the working set)

Parameter offload (`offload_param`, stage 3) moves this rank's parameter shard, P bytes per element
(in fp32 training it is also the master): with M = max_in_cpu,
    cpu:   host = P Ψ_r
    nvme:  disk = P Ψ_r,  host = P min(M, Ψ_r)   (the shards cached; needed ones may exceed M briefly)
In fp32 training with nvme, the gradient shard (also P bytes per element) goes the same way
([Note: gradient shards offloaded] in shard_store.py); in mixed precision it stays in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config.offload import DEFAULT_SUB_GROUP_SIZE


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes of offloaded optimizer state of one rank, by tier."""

    host: float
    disk: float


def predict_offload_bytes(shard_numel: float, state_bytes_per_elem: int, device: str, ratio: float = 1.0,
                          sub_group_size: float = 1e9, buffer_count: int = 4) -> OffloadBytes:
    """See the module docstring; `device` is 'cpu' or 'nvme'."""
    state = shard_numel * state_bytes_per_elem
    if device == "cpu":
        return OffloadBytes(host=state, disk=0.0)
    if device != "nvme":
        raise ValueError(f"offload device must be 'cpu' or 'nvme', got {device!r}")
    window = min(sub_group_size, shard_numel)
    return OffloadBytes(host=state * (1 - ratio) + buffer_count * window * state_bytes_per_elem, disk=state * ratio)


def predict_param_offload_bytes(shard_numel: float, param_bytes_per_elem: int, device: str,
                                max_in_cpu: float = 1e9) -> OffloadBytes:
    """Bytes of one rank's offloaded parameter shard by tier; `device` is 'cpu' or 'nvme'."""
    shard = shard_numel * param_bytes_per_elem
    if device == "cpu":
        return OffloadBytes(host=shard, disk=0.0)
    if device != "nvme":
        raise ValueError(f"offload device must be 'cpu' or 'nvme', got {device!r}")
    return OffloadBytes(host=min(max_in_cpu, shard_numel) * param_bytes_per_elem, disk=shard)


def offload_report_bytes(engine, numel: int, master_bytes: int, state_bytes: int,
                         shard_numel: Optional[float] = None, largest_chunk: int = 0) -> tuple[float, float]:
    """(predicted host bytes of the optimizer, predicted disk bytes) of a live offloaded engine;
    `shard_numel`: this rank's streamed elements where they are not numel / N (whole-tensor units);
    `largest_chunk`: a whole tensor larger than sub_group_size is a window alone, and the I/O slots grow to it."""
    zero = engine.config.zero_optimization
    section = zero.offload_optimizer
    shard = shard_numel if shard_numel is not None else numel / (engine.world_size if engine.stage >= 1 else 1)
    device = section.device.value
    tiers = predict_offload_bytes(shard, state_bytes, device, section.ratio if device == "nvme" else 1.0,
                                  max(DEFAULT_SUB_GROUP_SIZE if zero.sub_group_size is None else zero.sub_group_size,
                                      largest_chunk), section.buffer_count)
    return shard * master_bytes + tiers.host, tiers.disk


def param_offload_report_bytes(engine, numel: int, param_bytes_per_elem: int,
                               max_in_cpu: Optional[int] = None) -> tuple[float, float]:
    """(predicted parameter bytes in memory, predicted disk bytes) of a live engine with offload_param;
    `max_in_cpu`: the store's limit (`ShardStore.limit_numel`), else the config's."""
    section = engine.config.zero_optimization.offload_param
    limit = max_in_cpu if max_in_cpu is not None else section.max_in_cpu
    tiers = predict_param_offload_bytes(numel / engine.world_size, param_bytes_per_elem, section.device.value,
                                        1e9 if limit is None else limit)
    return tiers.host, tiers.disk
