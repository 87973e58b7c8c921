"""Where a gradient shard's reduced slices go besides its own tensor: the `GradDestination` seam.

A reduced slice always lands in the unit's gradient shard (`grad_shard.GradShard._deliver`, [Note: reduced
shard destination] there); where that shard then lives is chosen once, when the engine is composed from its
placement (engine/grad_path.py), never by the optimizer during a backward:

    memory          the default: the shard is the step's gradient, nothing else is told
    offload store   stage 3 fp32 offload_param nvme: the shard rests in files between uses (`GradShard.home`)
    host staging    ZeRO-Offload on a GPU: each delivery also queues a copy of the shard to a pinned host
                    buffer the host step reads (optim/grad_staging.py); this Protocol is what the shard calls

Calls run one way: the shard calls its destination, the destination never calls the shard back.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class GradDestination(Protocol):
    """Told around every delivery of a reduced slice into one shard (see the module docstring)."""

    def before_write(self, shard: torch.Tensor) -> None: ...  # at every wait(): `shard` may be written next

    def after_write(self, shard: torch.Tensor) -> None: ...   # a reduced slice was just added into `shard`
