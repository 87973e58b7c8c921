"""Which ranks share what under expert parallelism: `ExpertGroups` (one ep_size's two groups) and `ExpertPlan`
(a model's MoE layers bound to their groups, and its parameters split into dense and expert ones).

Over the engine's N ranks, for expert-parallel size P (DeepSpeed's layout, "E + D"):

    expert-parallel group        P consecutive ranks {jP .. jP+P-1}: the all-to-all; together they hold all E
                                 experts, rank jP+i holding experts i*L .. i*L+L-1 (L = E / P)
    expert-data-parallel group   N / P ranks {i, i+P, i+2P, ..}: the same experts, different data; an expert's
                                 parameters are ZeRO-sharded (and their gradients reduced) over this group

Dense parameters (everything else: attention, the gate, a residual MLP) are sharded over all N ranks. Both kinds
average gradients over N (the single-process model's mean over the global batch): an expert's gradient on its
rank is already the sum over its expert-parallel group's tokens (the all-to-all's backward brought them), so
the sum over the expert-data-parallel group is the sum over all N ranks' tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm.topology import consecutive_groups, strided_groups
from ..errors import ConfigError
from .layer import MoELayer
from .packed import PackedExperts, find_packed_experts


@dataclass(frozen=True)
class ExpertGroups:
    """The expert-parallel and expert-data-parallel groups of one ep_size (module docstring)."""

    ep_size: int
    expert_parallel: comm.ProcessGroup
    expert_data_parallel: comm.ProcessGroup

    @classmethod
    def make(cls, ep_size: int, process_group: comm.ProcessGroup) -> "ExpertGroups":
        """Every rank of `process_group` calls this, for each ep_size in the same order (collective)."""
        world = comm.get_world_size(process_group)
        if ep_size < 1 or world % ep_size:
            raise ConfigError(f"expert-parallel size {ep_size} (a MoE layer's ep_size, or expert_parallel.autoep_size) "
                              f"does not divide the {world} data-parallel ranks; use a size that divides the world size")
        whole = process_group if process_group is not None else dist.group.WORLD  # a group object, never None
        if world == 1:
            return cls(ep_size, whole, whole)
        # consecutive_groups gives `process_group` itself (None: the default group) where ep_size is the world
        ep_group = consecutive_groups(ep_size, process_group) if ep_size < world else whole
        return cls(ep_size, ep_group, strided_groups(ep_size, process_group))

    def close(self, process_group: comm.ProcessGroup) -> None:
        """Destroy the communicators `make` created (every rank, at the engine's close); never the engine's own."""
        whole = process_group if process_group is not None else dist.group.WORLD
        for group in (self.expert_parallel, self.expert_data_parallel):
            if group is not whole:
                comm.destroy_group(group, process_group)


@dataclass
class ExpertPlan:
    """A model's MoE layers, bound to their groups, and the split of each optimizer group into dense and expert
    parameters (one expert part per ep_size)."""

    layers: list  # MoELayer and PackedExperts (packed.py): ep_size, expert_parameters(), bind, unbind
    groups: dict[int, ExpertGroups] = field(default_factory=dict)  # by ep_size, in increasing ep_size

    @classmethod
    def of(cls, model: nn.Module, process_group: comm.ProcessGroup,
           packed_ep_size: Optional[int] = None) -> Optional["ExpertPlan"]:
        """None when the model has no MoE layer; otherwise the groups made and bound to every layer.
        `packed_ep_size` (config `expert_parallel.autoep_size`, None when not enabled): split the model's packed experts (packed.py) over
        that many ranks; binding keeps each rank's own experts."""
        layers = [m for m in model.modules() if isinstance(m, MoELayer)] + find_packed_experts(model, packed_ep_size)
        if not layers:
            return None
        plan = cls(layers)
        for ep_size in sorted({layer.ep_size for layer in layers}):
            plan.groups[ep_size] = ExpertGroups.make(ep_size, process_group)
        for layer in layers:
            layer.bind(plan.groups[layer.ep_size].expert_parallel)
        return plan

    def ep_size_of(self) -> dict[int, int]:
        """id(parameter) -> ep_size of every expert parameter."""
        return {id(p): layer.ep_size for layer in self.layers for p in layer.expert_parameters()}

    def split(self, groups: list[list[nn.Parameter]]) -> tuple[list[list[nn.Parameter]], dict[int, list[list]]]:
        """(dense groups, {ep_size: expert groups}): each optimizer group cut in two, indices kept."""
        ep_of = self.ep_size_of()
        dense = [[p for p in g if id(p) not in ep_of] for g in groups]
        experts = {size: [[p for p in g if ep_of.get(id(p)) == size] for g in groups] for size in self.groups}
        return dense, experts

    def close(self, process_group: comm.ProcessGroup) -> None:
        """Unbind the layers and destroy the groups (collective: every rank, at the engine's close)."""
        for layer in self.layers:
            layer.unbind()
        for groups in self.groups.values():
            groups.close(process_group)
        self.groups = {}

    def broadcast_experts(self) -> None:
        """Every rank's experts start as its expert-data-parallel group's first rank's (DDP's rule, per group;
        note: one broadcast per tensor)."""
        with torch.no_grad():
            for layer in self.layers:
                group = self.groups[layer.ep_size].expert_data_parallel
                for p in layer.expert_parameters():
                    comm.broadcast(p.data, 0, group, tag="init")

    def check_supported(self, config) -> None:
        """Refuse, naming the key, what expert parallelism does not run with yet (nothing is silently wrong)."""
        zero = config.zero_optimization
        if config.stage == 3:
            for key, on in (("offload_param", zero.offload_param.enabled), ("mics_shard_size", zero.mics_shard_size > 0),
                            ("zero_hpz_partition_size", zero.zero_hpz_partition_size > 1),
                            ("zero_quantized_weights", zero.zero_quantized_weights),
                            ("zero_quantized_gradients", zero.zero_quantized_gradients)):
                if on:
                    raise ConfigError(f"zero_optimization.{key} with expert-parallel MoE layers is not implemented; "
                                      f"remove it (stage 3 partitions the dense parameters, the experts are "
                                      f"sharded at stage 2 over their expert-data-parallel group)")
        if zero.offload_optimizer.enabled:
            raise ConfigError("offload_optimizer with expert-parallel MoE layers is not implemented yet; remove "
                              "zero_optimization.offload_optimizer")
