"""The gradient-to-update path of an engine, composed once from its placement: `compose_grad_staging`.

A reduced gradient slice lands in its unit's shard; where it goes from there is a fact of the placement
(offload/placement.py), decided before the first backward and never asked again:

    memory          the step reads the shard itself (every placement without ZeRO-Offload on a GPU)
    offload store   the shard rests in files between uses (stage 3 fp32 offload_param nvme); the step reads
                    it per window where it rests (optim/step_plan.py), so it gets no other destination
    host staging    ZeRO-Offload (`Placement.grad_staging`): each shard's deliveries queue a copy to a pinned
                    host buffer (optim/grad_staging.py) as the backward goes on; the host step reads those

The engine builds the staging here, gives each unit's gradient shard its destination
(`GradShard.deliver_to`, grads/grad_destination.py), hands the same staging to the sharded optimizer's
step plan, and arms it before each backward (`GradStaging.arm`: the boundary's deliveries are the step's).
The optimizer takes no part in the backward.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..offload.placement import Placement
from ..optim.grad_staging import GradStaging


def compose_grad_staging(units: Sequence, placement: Placement) -> Optional[GradStaging]:
    """The host staging `placement` asks for, each unit's in-memory gradient shard delivering into it (those
    resting in an offload store are copied per window at the step instead); None: the step reads the shards."""
    if placement.grad_staging is None:
        return None
    staging = GradStaging(placement.grad_staging, placement.compute.device, placement.masters.dtype)
    for index, unit in enumerate(units):
        if not unit.grad_offloaded:
            unit.grads.deliver_to(staging.destination(index))
    return staging
