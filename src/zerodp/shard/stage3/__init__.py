"""ZeRO stage 3 (the paper's Pos+g+p): parameters partitioned across ranks, gathered just in time.

    strategy.py    Stage3Sharding: what the engine drives (seams.ShardingStrategy); the gradient path
    partition.py   build_stage3_sharding: module units and flat units from a model
    wrap.py        which modules become module units and which one holds each parameter
    module_unit.py ModuleUnit: the forward/backward hooks that gather and release; TrainingState
    schedule.py    Schedule: the pass running, the forward stack, recorded order, prefetch trigger
    prefetch.py    the recorded execution order and the prefetch budget
    flat_unit.py   FlatUnit: one flat, sharded buffer of parameters (what the optimizer steps)
    shard_group.py ShardGroup: the two communicators, CUDA streams, live-memory counters
    params.py      PartitionedParameter: what a parameter is while only its shard exists
    gathered.py    gathered_parameters: full parameters outside forward
    init_context.py  init_context: parameters partitioned as the model is built

    hpz.py              ZeRO++ hpZ (Wang et al. 2023): secondary shards inside a node, so that the backward's gathers ...
    inference_cache.py  Stage 3 at evaluation and generation: flat units that stay gathered between forwards ...
    mics.py             MiCS (Zhang et al. 2022) and FSDP2's HSDP: shard inside a block of ranks, replicate across ...
"""

from .gathered import gathered_parameters
from .init_context import init_context
from .params import PartitionedParameter, PartitionedParameterError
from .partition import build_stage3_sharding
from .strategy import Stage3Sharding

__all__ = ["build_stage3_sharding", "Stage3Sharding", "gathered_parameters", "init_context", "PartitionedParameter",
           "PartitionedParameterError"]
