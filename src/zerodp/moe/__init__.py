"""Mixture of experts with expert parallelism beside ZeRO (docs/moe_ep.md).

    gating.py          TopKGate and its Routing: top-1/top-2, capacity, token drops, the load-balancing loss
    all_to_all.py      the differentiable all-to-all of dispatch and combine
    layer.py           MoELayer (route, dispatch, local experts, combine), MoE (DeepSpeed's arguments), the
                       registry answering is_expert_parameter
    packed.py          PackedExperts: transformers' packed experts (3-D [E, ...] tensors) split on the expert
                       dimension, tokens moved around the module's own forward by two hooks
    expert_groups.py   the expert-parallel and expert-data-parallel groups; a model's dense/expert split
    sharding.py        the engine's strategy over both parts (stages 0-3) and the norm over both groups
    consolidate.py     the single-process model's state dict from a live engine
    checkpoint.py      checkpoints that load at another expert-parallel or data-parallel size
"""

from .gating import Routing, TopKGate
from .layer import MoE, MoELayer, expert_ep_size, is_expert_parameter

__all__ = ["MoE", "MoELayer", "Routing", "TopKGate", "expert_ep_size", "is_expert_parameter"]
