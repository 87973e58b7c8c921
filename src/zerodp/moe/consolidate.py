"""The unsharded model of an expert-parallel run: `expert_full_state_dict`, the single-process model's state dict
(every expert under its global index; packed experts' tensors concatenated back on the expert dimension), from a
live engine at stages 0-3.

Each unit is gathered over the group its shards split over (a dense one over all ranks, an expert one over its
expert-data-parallel group), from the fp32 masters. A local expert `...experts.<i>` of expert-parallel rank j
is named `...experts.<j*L+i>`, the name the model with every expert (ep_size 1) gives it. The first
expert-parallel group (ranks 0..P-1 of the engine's group) holds every expert once; its ranks send theirs to
rank 0 (or to every rank, rank0_only=False).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import comm
from ..checkpoint.consolidate import gather_flat
from .expert_groups import ExpertPlan
from .packed import PackedExperts


def shard_group(unit) -> comm.ProcessGroup:
    """The group a unit's shards split over: a bucket's (stages 0-2), a stage-3 unit's shard group."""
    return unit.process_group if hasattr(unit, "process_group") else unit.shards.process_group


def global_expert_names(module: torch.nn.Module, plan: ExpertPlan) -> dict[str, str]:
    """Local state-dict key -> the single-process model's key, for every expert parameter and buffer of the MoE
    layers (packed experts keep their names: only their expert dimension is split, see expert_full_state_dict)."""
    module_names = {id(m): n for n, m in module.named_modules()}
    renamed = {}
    for layer in plan.layers:
        if isinstance(layer, PackedExperts):
            continue
        for local, expert in enumerate(layer.experts):
            name = module_names[id(expert)]
            parent, _, index = name.rpartition(".")
            if index != str(local):
                raise ValueError(f"expert {local} of a MoE layer is named {name!r}; expected a name ending in "
                                 f".{local} (the experts in an nn.ModuleList)")
            prefix = f"{parent}.{layer.global_expert_index(local)}."
            for key in expert.state_dict():
                renamed[f"{name}.{key}"] = prefix + key
    return renamed


@torch.no_grad()
def expert_full_state_dict(engine, plan: ExpertPlan, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The single-process model's full fp32 state dict on CPU (module docstring); every rank calls it."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    chunk_numel = engine.config.zero_optimization.allgather_bucket_size
    values: dict[str, torch.Tensor] = {}
    for unit, master in zip(engine.units, engine.optimizer.masters):
        flat = gather_flat(unit.layout, master, shard_group(unit), chunk_numel, True,
                           device=engine.placement.compute.device)
        for p, offset, numel, shape in zip(unit.params, unit.layout.offsets, unit.layout.numels, unit.layout.shapes):
            values[names[id(p)]] = flat[offset:offset + numel].view(shape).clone()
    for key, value in engine.module.state_dict(keep_vars=True).items():  # buffers: whole on every rank
        if key not in values:
            if any(value is p for p in engine.module.parameters()):
                raise NotImplementedError(f"full_state_dict of an expert-parallel model with a frozen parameter "
                                          f"({key}) is not implemented")
            values[key] = value.detach().float().cpu().clone() if value.is_floating_point() else value.cpu()
    renamed = global_expert_names(engine.module, plan)
    # packed experts keep their names; rank j's tensors are experts j*L.. of the single-process tensor
    packed = {names[id(p)] for layer in plan.layers if isinstance(layer, PackedExperts)
              for p in layer.expert_parameters()}
    group = engine.process_group
    largest = max(plan.groups)
    if any(size != largest for size in plan.groups):
        raise NotImplementedError("full_state_dict with MoE layers of different ep_size is not implemented")
    # ranks 0..P-1 (the first expert-parallel group) hold every expert once, rank j the j-th of each packed tensor
    first_group = comm.get_rank(group) < largest
    mine = {renamed[k]: v for k, v in values.items() if k in renamed} if first_group else {}
    slices = {k: values[k] for k in packed} if first_group else {}
    experts, pieces = {}, {k: [] for k in packed}
    # note: every expert travels once, pickled (small models); parts come in rank order, so in expert order
    for part, part_slices in comm.all_gather_object((mine, slices), group):
        experts.update(part)
        for k, v in part_slices.items():
            pieces[k].append(v)
    if rank0_only and comm.get_rank(group) != 0:
        return {}
    out: dict[str, torch.Tensor] = OrderedDict((k, torch.cat(pieces[k]) if k in packed else v)
                                               for k, v in values.items() if k not in renamed)
    out.update(sorted(experts.items()))
    return out
