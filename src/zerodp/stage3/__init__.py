"""ZeRO stage 3 (the paper's Pos+g+p): parameters partitioned across ranks, gathered just in time.

    strategy.py    what the engine drives: build_stage3_sharding, the Stage3Sharding strategy
    wrap.py        which modules become units and which unit holds each parameter
    units.py       FlatUnit: one flat, sharded buffer of parameters (what the optimizer steps)
    hooks.py       ModuleUnit: the forward/backward hooks that gather and release
    prefetch.py    the recorded execution order and the prefetch budget
    collectives.py ShardGroup: the two communicators, CUDA streams, live-memory counters
    params.py      PartitionedParameter: what a parameter is while only its shard exists
    gathered.py    gathered_parameters: full parameters outside forward
    init.py        init_context: parameters partitioned as the model is built
"""

from .gathered import gathered_parameters
from .init import init_context
from .params import PartitionedParameter, PartitionedParameterError
from .strategy import Stage3Sharding, build_stage3_sharding

__all__ = ["build_stage3_sharding", "Stage3Sharding", "gathered_parameters", "init_context", "PartitionedParameter",
           "PartitionedParameterError"]
