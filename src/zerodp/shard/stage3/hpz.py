"""ZeRO++ hpZ (Wang et al. 2023): secondary shards inside a node, so that the backward's gathers stay there.

[Note: secondary shards] Stage 3 gathers every unit twice per step over all N ranks (forward and
backward), so 2 of its 3 Psi cross the slow inter-node link once a job spans nodes. With
`zero_hpz_partition_size` k (normally the ranks per node), the N ranks form blocks of k consecutive
ranks; when a unit's forward gather is released, each rank keeps the 1/k slice of the gathered unit
that its position in the block selects (its secondary shard). Until the parameters change, later
gathers of that unit (the backward's, an activation-checkpoint recompute, the next micro-step's
forward under gradient accumulation) all-gather the k secondary shards of the block instead: the
same values, gathered inside the node. The optimizer still steps the primary shards (1/N) and the
secondary shards are dropped at every optimizer step (`Stage3Sharding.after_step`) and whenever a
shard is written otherwise (`FlatUnit.write_back`, checkpoint load), so no gather ever reads stale
values. Placement only: exact like plain stage 3, and checkpoints are plain stage 3's. Cost: 1/k of
each trainable unit's parameters per rank, from its forward until the step; forwards run without
autograd (evaluation, generation) keep none.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

from ... import comm
from ...comm import topology
from ...errors import ConfigError

log = logging.getLogger("zerodp")


class SecondaryGroup(NamedTuple):
    """The block of ranks that share secondary shards: its communicator and this rank's place in it."""

    process_group: comm.ProcessGroup
    rank: int
    world: int


def build_secondary_group(size: int, process_group: comm.ProcessGroup, *, whole_tensors: bool,
                          offload_param: bool) -> Optional[SecondaryGroup]:
    """The hpZ block of `size` consecutive ranks this rank belongs to, or None when hpZ is off (0, 1) or
    would change nothing (one block of every rank). Every rank of `process_group` must call it."""
    world = comm.get_world_size(process_group)
    # as DeepSpeed: a block larger than the job is the whole job (public configs write 8 or 16, the ranks per
    # node of the cluster they were written for, and run unchanged on fewer ranks)
    size = min(size, world)
    if size <= 1:
        return None
    if world % size:
        raise ConfigError(f"zero_hpz_partition_size={size} does not divide the {world} ranks; use a divisor of the "
                          f"world size, normally the ranks per node (LOCAL_WORLD_SIZE)")
    if whole_tensors:
        raise ConfigError("zero_hpz_partition_size with an optimizer that reads whole tensors (Muon, Adafactor) is not "
                          "implemented: their units have unequal shards; remove the key or use an elementwise optimizer")
    if offload_param:
        raise ConfigError("zero_hpz_partition_size with offload_param is not implemented (the secondary shards would "
                          "live beside the offloaded primaries); remove one of the two")
    if size == world:
        log.info("zerodp hpZ: zero_hpz_partition_size=%d is the world size: the secondary shards would be the primary "
                 "ones, so hpZ changes nothing", size)
        return None
    layout = topology.node_layout(process_group)  # from the hosts its ranks run on (comm/topology.py)
    if not layout.uniform or layout.ranks_per_node % size:
        log.warning("zerodp hpZ: blocks of %d ranks do not fit inside nodes of %d ranks, so the backward's gathers still "
                    "cross nodes; set zero_hpz_partition_size to the ranks per node (or a divisor of it)", size,
                    layout.ranks_per_node)
    group = topology.consecutive_groups(size, process_group)
    return SecondaryGroup(group, comm.get_rank(group), size)
