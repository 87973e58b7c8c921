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
gradient: grads/reduce_queue.py's control collective) is agreed over all N ranks, so every replica
takes the same decisions; gradient norms and overflow checks sum over the block only (the replicas'
shards are the same values). Placement only: exact like plain stage 3. Checkpoints are plain
stage 3's: the first block's ranks write the shards, every rank its RNG state.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch

from ... import comm
from ...comm import topology
from ...errors import ConfigError

log = logging.getLogger("zerodp")


class ReplicatedShards(NamedTuple):
    """The communicators of a MiCS/HSDP layout, for this rank."""

    shard_group: comm.ProcessGroup      # this rank's block: gathers
    reduce_group: comm.ProcessGroup     # a second communicator over the block: reduce-scatters
    replicate_group: comm.ProcessGroup  # the ranks holding the same shard in every block (None: one block)
    replica_index: int                  # which block this rank is in (0: the one that writes checkpoints)
    two_hops: Optional["TwoHops"] = None  # mics_hierarchical_params_gather: a block's gathers in two hops
    made: tuple = ()                      # the communicators built here (destroyed at close)


class TwoHops(NamedTuple):
    """[Note: two-hop gathers] A block of m ranks over k nodes of p ranks each (m = k p, torchrun's numbering:
    block position b = p j + i on node j, place i). Gathering the m shards in one collective over the block
    sends every shard across the slow link; in two hops only k do:
        across  all-gather over the k ranks at place i (one per node):  [s(i + p j') for j' < k]
        inside  all-gather of those over the p ranks of this node:      [s(i' + p j') for i' < p, j' < k]
    then a transpose puts shard b = p j' + i' at its place. The same values, in a staging buffer of the
    unit's size while the gather runs."""

    across: comm.ProcessGroup
    inside: comm.ProcessGroup
    per_node: int   # p
    nodes: int      # k


def build_replicated_shards(shard_size: int, hierarchical_gather: bool, process_group: comm.ProcessGroup, *,
                            zero) -> Optional[ReplicatedShards]:
    """The MiCS blocks of `shard_size` ranks, or None when MiCS is off (<= 0) or would change nothing
    (one block of every rank). Every rank of `process_group` must call it."""
    world = comm.get_world_size(process_group)
    if shard_size <= 0 or (shard_size >= world and not hierarchical_gather):
        return None
    shard_size = min(shard_size, world)  # one block of every rank: no replicas, but the two-hop gathers
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
    two_hops = _two_hops(shard_size, world, process_group) if hierarchical_gather else None
    if shard_size < world:
        shard_group = topology.consecutive_groups(shard_size, process_group)
        reduce_group = topology.consecutive_groups(shard_size, process_group)  # see [Note: two communicators]
        replicate_group = topology.strided_groups(shard_size, process_group)
        made = (shard_group, reduce_group, replicate_group)
    else:  # one block: the job's group gathers, a second communicator over it reduces
        shard_group, reduce_group, replicate_group = process_group, comm.new_group_like(process_group), None
        made = (reduce_group,)
    hops = (two_hops.across, two_hops.inside) if two_hops is not None else ()
    return ReplicatedShards(shard_group, reduce_group, replicate_group, comm.get_rank(process_group) // shard_size,
                            two_hops, made + hops)


def _two_hops(shard_size: int, world: int, process_group: comm.ProcessGroup) -> Optional[TwoHops]:
    """The communicators of [Note: two-hop gathers], or None when a block sits inside one node."""
    layout = topology.node_layout(process_group)  # from the hosts its ranks run on (comm/topology.py)
    per_node = layout.ranks_per_node
    if shard_size <= per_node and layout.uniform:
        log.info("zerodp MiCS: a block of %d ranks sits inside a node of %d: mics_hierarchical_params_gather "
                 "changes nothing", shard_size, per_node)
        return None
    if not layout.uniform or shard_size % per_node:
        raise ConfigError(f"mics_hierarchical_params_gather needs blocks made of whole nodes: mics_shard_size="
                          f"{shard_size} is not a multiple of the {per_node} ranks per node (by host), or the nodes "
                          f"run different numbers of ranks or number them not consecutively; set mics_shard_size to a "
                          f"multiple of it, with ranks numbered node by node")
    nodes = shard_size // per_node
    blocks = range(0, world, shard_size)
    across = topology.subgroup_of([[b + i + per_node * j for j in range(nodes)] for b in blocks
                                   for i in range(per_node)], process_group)
    inside = topology.subgroup_of([[b + per_node * j + i for i in range(per_node)] for b in blocks
                                   for j in range(nodes)], process_group)
    return TwoHops(across, inside, per_node, nodes)


def all_gather_in_two_hops(full: torch.Tensor, shard: torch.Tensor, hops: TwoHops, async_op: bool,
                           what: str = "") -> comm.Handle:
    """[Note: two-hop gathers]: `full` (m shards) from every rank's `shard`; the second hop and the transpose run
    in the handle's wait."""
    n = shard.numel()
    across = torch.empty(hops.nodes * n, dtype=shard.dtype, device=shard.device)
    first = comm.all_gather(across, shard, hops.across, async_op=True, tag="param", what=what)

    def finish() -> None:
        first.wait()
        staged = torch.empty(hops.per_node * hops.nodes * n, dtype=shard.dtype, device=shard.device)
        comm.all_gather(staged, across, hops.inside, tag="param", what=what)
        full.view(hops.nodes, hops.per_node, n).copy_(staged.view(hops.per_node, hops.nodes, n).transpose(0, 1))

    handle = comm.Handle(None, finish)
    if not async_op:
        handle.wait()
    return handle


def close_replicated_shards(groups: ReplicatedShards) -> None:
    """Destroy the communicators (every rank of the job, at close)."""
    for group in groups.made:
        comm.destroy_group(group)
