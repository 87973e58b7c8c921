"""A mixture-of-experts layer with expert parallelism: `MoELayer` (route, dispatch, run the local experts,
combine) and `MoE` (DeepSpeed's `deepspeed.moe.layer.MoE` arguments: the gate, copies of one expert, and the
optional residual MLP of PR-MoE).

Expert parallelism: the E experts are split over the ep_size ranks of an expert-parallel group, L = E / ep_size
consecutive experts per rank (rank j holds global experts j*L .. j*L+L-1 as its local 0 .. L-1). Each rank
gates its own tokens, then

    dispatch   [S, M] tokens -> [E, C, M] slots -> all-to-all over the group -> [ep_size, L, C, M]
    experts    local expert i runs on its slots that hold a token (from every rank of the group)
    combine    [ep_size, L, C, M] -> all-to-all back -> [E, C, M] -> weighted sum per token -> [S, M]

An expert that no rank of the group routed a token to is not called, so its parameters get no gradient at all
(None), as in the single-process model holding every expert: optimizers skip it as torch's do. Its slots are
learned from a second, small all-to-all of the slot flags.

The groups are the engine's business: `zerodp.initialize` finds every `MoELayer`, makes the expert-parallel
groups of its ep_size over the engine's ranks (consecutive ranks, DeepSpeed's layout) and binds them
(`bind`); a layer used outside an engine with ep_size > 1 is bound by hand. Which parameters are experts'
is asked of the layer (`expert_parameters`); `is_expert_parameter` answers for any parameter (DeepSpeed's
`is_moe_param`), from a weak registry the layers fill, so no attribute is set on a parameter.
"""

from __future__ import annotations

import copy
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from .all_to_all import all_to_all
from .gating import TopKGate

# id(parameter) -> (a weak reference to it, the ep_size of the layer whose expert it is). By identity, not a
# WeakKeyDictionary: that compares colliding keys with ==, which a tensor answers elementwise. The reference's
# callback drops the entry when the parameter dies, so a dropped model leaves nothing behind.
_EXPERT_PARAMETERS: dict[int, tuple[weakref.ref, int]] = {}


def register_expert_parameter(param: nn.Parameter, ep_size: int) -> None:
    """Record `param` as an expert's of a layer split over `ep_size` ranks (what `is_expert_parameter` answers)."""
    key = id(param)
    _EXPERT_PARAMETERS[key] = (weakref.ref(param, lambda _ref: _EXPERT_PARAMETERS.pop(key, None)), ep_size)


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether `param` belongs to an expert of a `MoELayer` (sharded over the expert-data-parallel group)."""
    entry = _EXPERT_PARAMETERS.get(id(param))
    return entry is not None and entry[0]() is param


def expert_ep_size(param: torch.Tensor) -> int:
    """The ep_size of the layer whose expert `param` is."""
    if not is_expert_parameter(param):
        raise KeyError("not a parameter of a MoE layer's experts")
    return _EXPERT_PARAMETERS[id(param)][1]


class MoELayer(nn.Module):
    """Route tokens with `gate` to `experts` (this rank's L local experts, an iterable of modules), with the
    experts split over an expert-parallel group of `ep_size` ranks (module docstring)."""

    def __init__(self, gate: TopKGate, experts: nn.Module, ep_size: int) -> None:
        super().__init__()
        num_local = len(experts)
        if ep_size < 1 or gate.num_experts != ep_size * num_local:
            raise ValueError(f"{gate.num_experts} experts over ep_size={ep_size} ranks with {num_local} local "
                             f"experts: num_experts must be ep_size x the local experts")
        self.gate, self.experts = gate, experts
        self.ep_size, self.num_local_experts, self.num_experts = ep_size, num_local, gate.num_experts
        self.ep_group: comm.ProcessGroup = None
        self.ep_rank = 0
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None
        for p in self.expert_parameters():
            register_expert_parameter(p, ep_size)

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's experts' parameters (sharded over the expert-data-parallel group)."""
        return list(self.experts.parameters())

    def bind(self, ep_group: comm.ProcessGroup) -> None:
        """Use `ep_group` (ep_size ranks; this rank's experts are global experts ep_rank*L ..) for the all-to-alls."""
        size = comm.get_world_size(ep_group)
        if size != self.ep_size:
            raise ValueError(f"an expert-parallel group of {size} ranks bound to a MoE layer with ep_size="
                             f"{self.ep_size}; the group must have ep_size ranks")
        self.ep_group, self.ep_rank = ep_group, comm.get_rank(ep_group)

    def unbind(self) -> None:
        """Forget the expert-parallel group (the engine closed and destroyed it)."""
        self.ep_group = None

    def global_expert_index(self, local_index: int) -> int:
        """The index among all E experts of this rank's local expert `local_index`."""
        return self.ep_rank * self.num_local_experts + local_index

    def forward(self, hidden: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"this MoE layer splits its experts over ep_size={self.ep_size} ranks but has no "
                               f"expert-parallel group: train it under zerodp.initialize (which makes and binds the "
                               f"groups) or call layer.bind(group) with a group of {self.ep_size} ranks")
        model_dim = hidden.shape[-1]
        tokens = hidden.reshape(-1, model_dim)
        routing = self.gate(tokens, self.ep_group, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        capacity = routing.capacity
        slots = torch.einsum("sec,sm->ecm", routing.dispatch.to(tokens.dtype), tokens)
        # [Note: every rank's backward runs both all-to-alls] Whether this rank's experts ran (and whether its
        # tokens need a gradient) differs between ranks; the all-to-alls' backward must not: a rank whose
        # graph skipped them would leave the others waiting. So whenever anything here trains, the slots and
        # each expert's output stay in the graph on every rank (an expert without tokens adds zeros).
        trains = torch.is_grad_enabled() and (tokens.requires_grad or
                                              any(p.requires_grad for p in self.experts.parameters()))
        if trains and not slots.requires_grad:
            slots.requires_grad_()  # a leaf whose gradient is dropped: it only carries backward to the all-to-all
        # which slots hold a token, sent along (no gradient): an expert with none is not called
        filled = all_to_all(routing.dispatch.any(dim=0).to(torch.uint8), self.ep_group, tag="moe slots")
        received = all_to_all(slots, self.ep_group, tag="moe dispatch")
        received = received.reshape(self.ep_size, self.num_local_experts, capacity, model_dim)
        filled = filled.reshape(self.ep_size, self.num_local_experts, capacity).bool()
        outputs = []
        for i, expert in enumerate(self.experts):
            rows = received[:, i].reshape(-1, model_dim)
            used = filled[:, i].reshape(-1)
            out = rows * 0  # zeros in the graph: see [Note: every rank's backward runs both all-to-alls]
            # note: a host read per expert (whether any slot is filled, and which): the single-process model
            # calls an expert only on the tokens routed to it, and so does this
            index = used.nonzero().squeeze(1)
            if index.numel():
                result = expert(rows.index_select(0, index))
                if isinstance(result, tuple):
                    result = result[0]  # DeepSpeed's rule: an expert returning (output, bias) gives its output
                out = out.index_copy(0, index, result.to(rows.dtype))
            outputs.append(out.reshape(self.ep_size, 1, capacity, model_dim))
        expert_out = torch.cat(outputs, dim=1).reshape(self.num_experts, capacity, model_dim)
        combined = all_to_all(expert_out, self.ep_group, tag="moe combine")
        mixed = torch.einsum("sec,ecm->sm", routing.combine.to(combined.dtype), combined)
        return mixed.reshape(hidden.shape)


def residual_mix(output: torch.Tensor, hidden: torch.Tensor, mlp: nn.Module, coefficient: nn.Module) -> torch.Tensor:
    """PR-MoE's residual: softmax(coefficient(hidden)) weighs the experts' output against the dense MLP's."""
    dense = mlp(hidden)
    if isinstance(dense, tuple):
        dense = dense[0]
    coef = F.softmax(coefficient(hidden), dim=-1)
    return output * coef[..., 0:1] + dense * coef[..., 1:]


class MoE(nn.Module):
    """A mixture-of-experts layer: `num_experts` copies of `expert` (deep copies, so they start equal, as
    DeepSpeed's), split over `ep_size` ranks; forward returns (output, l_aux, exp_counts).

    `k`, `capacity_factor`, `eval_capacity_factor`, `min_capacity`, `noisy_gate_policy`, `drop_tokens`,
    `use_rts`, `top2_2nd_expert_sampling`: the gate's (gating.py). `use_residual`: PR-MoE, `expert` itself
    becomes a dense MLP mixed in by a learned coefficient (residual_mix)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}: each rank of the "
                             f"expert-parallel group holds num_experts / ep_size experts")
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_experts // ep_size))
        self.moe = MoELayer(gate, experts, ep_size)
        self.use_residual = use_residual
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        output = self.moe(hidden, used_token)
        if self.use_residual:
            output = residual_mix(output, hidden, self.mlp, self.coefficient)
        return output, self.moe.l_aux, self.moe.exp_counts
