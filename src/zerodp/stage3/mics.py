"""MiCS (Zhang et al. 2022) and FSDP2's HSDP: shard inside a block of ranks, replicate across blocks.

[Note: replicated shards] With `mics_shard_size` m (stage 3), the N ranks form N/m blocks of m
consecutive ranks (torchrun numbers ranks node by node, so m = the ranks per node is FSDP2's HSDP:
shard inside a node, replicate across nodes). Every block holds one full copy of the model states,
sharded over its m ranks: a rank keeps 1/m of each unit (parameters, gradients, optimizer state), not
1/N, and its gathers run inside the block. The ranks at the same position of every block hold the same
shard, and form a replica group. Per unit and micro-step:
    gather  all-gather over the block (m ranks)                              forward and backward
    reduce  reduce-scatter over the block, then all-reduce of the slice over the replica group (N/m
            ranks), then divide by N: every replica gets the gradient of the global batch
so the inter-node traffic is the replica all-reduce alone (2 Psi/m per rank when blocks are nodes).
What the ranks must agree on (which units need a second reduction round, which parameters got a
gradient: flat/reduce_queue.py's control collective) is agreed over all N ranks, so every replica
takes the same decisions; gradient norms and overflow checks sum over the block only (the replicas'
shards are the same values). Placement only: exact like plain stage 3. Checkpoints are plain
stage 3's: the first block's ranks write the shards, every rank its RNG state.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .. import comm
from ..comm import topology
from ..errors import ConfigError


class ReplicatedShards(NamedTuple):
    """The communicators of a MiCS/HSDP layout, for this rank."""

    shard_group: comm.ProcessGroup      # this rank's block: gathers
    reduce_group: comm.ProcessGroup     # a second communicator over the block: reduce-scatters
    replicate_group: comm.ProcessGroup  # the ranks holding the same shard in every block
    replica_index: int                  # which block this rank is in (0: the one that writes checkpoints)


def build_replicated_shards(shard_size: int, hierarchical_gather: bool, process_group: comm.ProcessGroup, *,
                            zero) -> Optional[ReplicatedShards]:
    """The MiCS blocks of `shard_size` ranks, or None when MiCS is off (<= 0) or would change nothing
    (one block of every rank). Every rank of `process_group` must call it."""
    world = comm.get_world_size(process_group)
    if shard_size <= 0 or shard_size >= world:
        return None
    if hierarchical_gather:
        raise ConfigError("mics_hierarchical_params_gather=true is not implemented (zerodp gathers inside a MiCS block "
                          "in one collective); remove the key or set false")
    if world % shard_size:
        raise ConfigError(f"mics_shard_size={shard_size} does not divide the {world} ranks; use a divisor of the world "
                          f"size, normally the ranks per node (LOCAL_WORLD_SIZE: FSDP2's HSDP)")
    clashes = [name for name, on in (("zero_hpz_partition_size", zero.zero_hpz_partition_size > 1),
                                     ("zero_quantized_weights", zero.zero_quantized_weights),
                                     ("zero_quantized_gradients", zero.zero_quantized_gradients),
                                     ("offload_param", zero.offload_param.enabled),
                                     ("offload_optimizer", zero.offload_optimizer.enabled)) if on]
    if clashes:
        raise ConfigError(f"mics_shard_size with {', '.join(clashes)} is not implemented; use one of them")
    shard_group = topology.consecutive_groups(shard_size, process_group)
    reduce_group = topology.consecutive_groups(shard_size, process_group)  # see [Note: two communicators]
    replicate_group = topology.strided_groups(shard_size, process_group)
    return ReplicatedShards(shard_group, reduce_group, replicate_group, comm.get_rank(process_group) // shard_size)


def close_replicated_shards(groups: ReplicatedShards) -> None:
    """Destroy the three communicators (every rank of the job, at close)."""
    for group in (groups.shard_group, groups.reduce_group, groups.replicate_group):
        comm.destroy_group(group)
