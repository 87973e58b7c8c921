"""`deepspeed.moe.layer.MoE`: DeepSpeed's mixture-of-experts layer on zerodp's (zerodp.moe, docs/moe_ep.md).

The same arguments, forward signature (hidden_states, used_token) -> (output, l_aux, exp_counts) and
parameter names as DeepSpeed 0.19.8 (`deepspeed_moe.gate.wg.weight`, `deepspeed_moe.experts.deepspeed_experts.
<local index>.*`, `mlp.*` and `coefficient.*` with use_residual), so a DeepSpeed script and its state dicts run
unchanged. The expert-parallel groups are made by the engine (`deepspeed.initialize`), as DeepSpeed's engine
does through `set_deepspeed_parallelism`. Refused, with the reason: use_tutel (Tutel's kernels) and
enable_expert_tensor_parallelism (experts sliced by tensor parallelism).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from ....moe.gating import TopKGate
from ....moe.layer import MoELayer, residual_mix


class Experts(nn.Module):
    """DeepSpeed's container of this rank's experts (`deepspeed_experts`: deep copies of one expert)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name

    def __len__(self) -> int:
        return len(self.deepspeed_experts)

    def __iter__(self):
        return iter(self.deepspeed_experts)


class MoE(nn.Module):
    """DeepSpeed's MoE layer (module docstring); the routing options mean what they mean in DeepSpeed."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError("deepspeed.moe.layer.MoE(use_tutel=True): zerodp has no Tutel kernels; "
                                      "use_tutel=False routes the same tokens with torch operations")
        if enable_expert_tensor_parallelism:
            raise NotImplementedError("deepspeed.moe.layer.MoE(enable_expert_tensor_parallelism=True) is not "
                                      "implemented in zerodp; leave it False (experts are whole on their rank)")
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"Number of experts ({num_experts}) should be divisible by expert parallel size "
                             f"({ep_size})")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size, self.num_experts = ep_size, num_experts
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.deepspeed_moe = MoELayer(gate, Experts(expert, self.num_local_experts, self.expert_group_name), ep_size)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this to make the groups; zerodp's engine makes and binds them itself."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError("use_data_before_expert_parallel_=True (the D + E rank layout) is not "
                                      "implemented in zerodp; the default E + D layout is")

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output = residual_mix(output, hidden_states, self.mlp, self.coefficient)
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
