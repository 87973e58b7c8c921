"""Building the stage-3 strategy from a model: `build_stage3_sharding`.

Module units come from wrap.py's plan; inside each, parameters are grouped into flat units by
(optimizer group, persistent or not, dtype, device); small frozen parameters stay whole. Everything
a lower layer needs is passed at its construction: the shard group to flat units, the flat units
and the shared `Schedule` to module units, all of them to the strategy.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ... import comm
from ...config import ZeroConfig
from ...errors import ConfigError
from ..grads.grad_arithmetic import GradArithmetic
from ...offload.null_store import NullShardStore
from ...offload.tier import build_grad_offload, build_param_offload
from .flat_unit import FlatUnit
from .hpz import build_secondary_group
from .mics import build_replicated_shards
from .inference_cache import InferenceCache
from .module_unit import ModuleUnit
from .params import owner_of
from .schedule import Schedule
from .shard_group import ShardGroup
from .strategy import Stage3Sharding
from .wrap import choose_unit_modules, plan_units


def build_stage3_sharding(model: nn.Module, groups: list[list[nn.Parameter]], config: ZeroConfig,
                          process_group: comm.ProcessGroup, whole: Optional[list[bool]] = None,
                          arithmetic: Optional[GradArithmetic] = None, *,
                          forward_only: bool = False, round_views: bool = False) -> Stage3Sharding:
    """Partition `model`'s parameters into units and hook its modules (see the module docstring).

    `groups` are the optimizer's param groups, trainable parameters only, in model order; `whole[g]`:
    group g's units give each rank whole tensors (flat/whole_tensor_layout.py); `arithmetic`: the dtypes and
    divisors of every unit's gradient reduction (None: averaged in the parameters' dtype). `forward_only`
    (no optimizer, `groups` empty): every parameter is laid out as frozen, whatever its requires_grad, so no
    unit has a gradient or optimizer state; the model may then have no unit at all (every parameter small).
    `round_views`: each unit's per-round gradient buffer is handed to autograd as views (placement.py).
    """
    if forward_only and groups:
        raise ValueError("build_stage3_sharding(forward_only=True) lays out no trainable parameter; pass groups=[]")
    whole = whole or [False] * len(groups)
    zero = config.zero_optimization
    if any(whole) and (zero.zero_quantized_weights or zero.zero_quantized_gradients):
        raise ConfigError("zero_quantized_weights/zero_quantized_gradients with an optimizer that reads whole tensors "
                          "(Muon, Adafactor) is not implemented: their units have unequal shards; remove the ZeRO++ "
                          "keys or use an elementwise optimizer")
    params = list(model.parameters())
    if not params:
        raise ValueError("zerodp stage 3: the model has no parameters")
    if any(isinstance(owner_of(p), FlatUnit) for p in params):
        raise ValueError("zerodp stage 3: the model is already partitioned by another engine")
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
    replicated = build_replicated_shards(zero.mics_shard_size, zero.mics_hierarchical_params_gather, process_group,
                                         zero=zero)
    if replicated is not None and any(whole):
        raise ConfigError("mics_shard_size with an optimizer that reads whole tensors (Muon, Adafactor) is not "
                          "implemented; remove the key or use an elementwise optimizer")
    secondary = build_secondary_group(zero.zero_hpz_partition_size, process_group, whole_tensors=any(whole),
                                      offload_param=zero.offload_param.enabled)
    shards = ShardGroup(process_group, params[0].device, use_all_reduce=not zero.reduce_scatter,
                        quantized_weights=zero.zero_quantized_weights, quantized_gradients=zero.zero_quantized_gradients,
                        secondary=secondary, replicated=replicated)
    plans = plan_units(model, choose_unit_modules(model, zero.stage3_unit_modules, zero.stage3_unit_min_params))
    threshold = zero.stage3_param_persistence_threshold
    # offload_param: where sharded units' parameter shards live between uses (a null store: with the unit)
    param_home = build_param_offload(config, sum(p.numel() for p in params), params[0].element_size(),
                                     max(p.numel() for p in params), process_group, params[0].device) or NullShardStore()
    grad_home = build_grad_offload(config, param_home)  # fp32 offload_param nvme: the gradient shards too, or None
    flats: list[FlatUnit] = []
    owned_by_unit: list[tuple] = []
    # whole-tensor units are balanced across units: each on top of the elements ranks own in earlier ones
    owner_loads = (0,) * shards.world
    for plan in plans:
        buckets: dict[tuple, tuple[list, list]] = {}
        for p, name in zip(plan.params, plan.names):
            persistent = p.numel() < threshold
            frozen = forward_only or not p.requires_grad
            if frozen and persistent:
                continue  # small and frozen: stays whole, no unit, no state
            key = (-1 if frozen else group_of[id(p)], persistent, p.dtype, p.device)
            ps, ns = buckets.setdefault(key, ([], []))
            ps.append(p)
            ns.append(name)
        owned = []
        for (group_index, persistent, _, _), (ps, ns) in buckets.items():
            flat = FlatUnit(ps, ns, group_index, shards, index=len(flats), module_name=plan.name or "<root>",
                            trainable=group_index >= 0, persistent=persistent,
                            whole_tensors=group_index >= 0 and whole[group_index], owner_loads=owner_loads,
                            param_home=param_home, grad_home=grad_home, arithmetic=arithmetic,
                            round_views=round_views)
            if flat.layout.whole_tensors:
                owner_loads = flat.layout.loads_after
            flats.append(flat)
            owned.append(flat)
        if owned or plan.module is model:
            owned_by_unit.append((plan, owned))
    prefetch_numel = zero.stage3_prefetch_bucket_size
    if prefetch_numel is None:
        # Default: one unit ahead (the largest unit below the root), as FSDP prefetches. Enough to overlap
        # each gather with the previous unit's compute; a larger budget only holds more gathered memory
        # (measured on the 33.7M benchmark GPT: 50M elements ahead, DeepSpeed's default, peaks 110 MiB
        # higher per rank than one unit ahead).
        prefetch_numel = max((sum(f.layout.padded_numel for f in owned if not f.persistent)
                              for plan, owned in owned_by_unit if plan.module is not model), default=0)
    # the gathered buffers' element size (the parameters' dtype; a model without units keeps nothing)
    element_size = flats[0].gathered.tensor.element_size() if flats else params[0].element_size()
    inference = InferenceCache(shards, params[0].device, element_size,
                               zero.stage3_inference_memory_fraction, zero.stage3_max_live_parameters)
    schedule = Schedule(flats, shards, prefetch_numel, zero.stage3_max_live_parameters, inference)
    module_units = [ModuleUnit(plan.module, plan.name, owned, schedule, is_root=plan.module is model)
                    for plan, owned in owned_by_unit]
    return Stage3Sharding(model, module_units, flats, shards, schedule, zero.overlap_comm, param_home=param_home,
                          grad_home=grad_home)
