"""Packed experts split over ranks: `PackedExperts`, one Hugging Face transformers experts module (every expert's
weights in 3-D tensors [E, ...], e.g. `gate_up_proj`, `down_proj`) whose experts an expert-parallel group of P
ranks holds E / P each; `find_packed_experts`, the modules of a model that can be split, or the error saying why not.

The module's own forward does the expert arithmetic; zerodp moves tokens around it with two hooks, so no model
code is copied and the parameter names stay the model's (only the expert dimension shrinks to L = E / P):

    pre-hook   forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) of global expert ids
               -> every (token, choice) pair in a slot of [E, C] (C: the largest expert count over the group)
               -> all-to-all of the slots, their routing weights and their filled flags (moe/all_to_all.py)
               -> the module's forward runs on the filled rows only, one choice per row, with local ids 0..L-1
    post-hook  the rows' outputs -> all-to-all back -> summed per token in expert order -> [T, H]

The contract relied on is transformers' experts interface (`integrations.moe.use_experts_implementation`):
`num_experts`, parameters whose first dimension is the expert, and a forward whose output for a token is the sum
over its choices of what each choice alone gives. It holds for the eager, batched_mm and grouped_mm kernels,
whatever they do with the routing weight (it travels with the row). Each row is computed by the same module
code as in one process; the sums over a token's choices are in the same (expert) order.

[Note: packed experts keep their Parameters] `split` narrows each parameter in place (`param.data =` its slice)
rather than making new Parameters: the user's optimizer was built over these objects before zerodp.initialize,
and its param groups must still name them. The full tensor's storage is dropped with its last reference.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, Optional

import torch
from torch import nn

from .. import comm
from ..errors import ConfigError
from .all_to_all import all_to_all
from .layer import MoELayer, register_expert_parameter

INPUTS = ("hidden_states", "top_k_index", "top_k_weights")  # transformers' experts forward, in order


class _Dispatched(NamedTuple):
    """What the post-hook needs of one forward's dispatch (lives from the pre-hook to the post-hook)."""

    hidden: torch.Tensor     # [T, H] this rank's tokens (for the output's shape and dtype)
    token: torch.Tensor      # [T*k] the token of each (token, choice) pair, pairs in expert order
    slot: torch.Tensor       # [T*k] each pair's slot in the [E*C] send buffer
    received: torch.Tensor   # [E*C, H] the rows received for this rank's experts (P slices of L*C)
    weights: torch.Tensor    # [E*C] their routing weights
    used: torch.Tensor       # indices of the received rows that hold a pair
    trains: bool             # whether backward will run (every rank's backward runs both all-to-alls)


class PackedExperts:
    """One packed-experts module, split over an expert-parallel group of `ep_size` ranks (module docstring)."""

    def __init__(self, module: nn.Module, name: str, ep_size: int) -> None:
        self.module, self.name, self.ep_size = module, name, ep_size
        self.num_experts = module.num_experts
        if self.num_experts % ep_size:
            raise ConfigError(f"expert_parallel.autoep_size={ep_size} does not divide the {self.num_experts} experts "
                              f"of {name} ({type(module).__name__}); use a size that divides num_experts")
        self.num_local_experts = self.num_experts // ep_size
        self.ep_group: comm.ProcessGroup = None
        self.ep_rank = 0
        self.bound = False  # between bind and unbind (the engine's life)
        self.split_done = False
        self._pending: Optional[_Dispatched] = None

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's experts' parameters (sharded over the expert-data-parallel group)."""
        return list(self.module.parameters(recurse=False))

    def bind(self, ep_group: comm.ProcessGroup) -> None:
        """Use `ep_group` for the all-to-alls; the first time, keep only this rank's experts (`split`)."""
        self.ep_group, self.ep_rank, self.bound = ep_group, comm.get_rank(ep_group), True
        if not self.split_done:
            self.split()

    def unbind(self) -> None:
        """The engine closed: forward refuses from now on (this module holds only its rank's experts)."""
        self.ep_group, self.bound = None, False

    @torch.no_grad()
    def split(self) -> None:
        """Keep experts ep_rank*L .. ep_rank*L+L-1 ([Note: packed experts keep their Parameters])."""
        first = self.ep_rank * self.num_local_experts
        for p in self.expert_parameters():
            p.data = p.data[first:first + self.num_local_experts].clone()
            register_expert_parameter(p, self.ep_size)  # is_expert_parameter (DeepSpeed's is_moe_param) answers for it
        self.module.num_experts = self.num_local_experts  # the module's forward now sees L experts, ids 0..L-1
        # kept after the engine closes: the split module then refuses to run (_dispatch)
        self.module.register_forward_pre_hook(self._dispatch, with_kwargs=True)
        self.module.register_forward_hook(self._combine)
        self.split_done = True

    def global_expert_index(self, local_index: int) -> int:
        """The index among all E experts of this rank's local expert `local_index`."""
        return self.ep_rank * self.num_local_experts + local_index

    def _inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        values = list(args) + [kwargs.pop(n) for n in INPUTS[len(args):] if n in kwargs]
        if len(values) != len(INPUTS) or kwargs:
            raise TypeError(f"{self.name} ({type(self.module).__name__}) was called with {len(args)} positional "
                            f"arguments and {sorted(kwargs)}; expert parallelism passes exactly {INPUTS}")
        return values

    def _dispatch(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self.bound:
            raise RuntimeError(f"{self.name} holds {self.num_local_experts} of {self.num_experts} experts (split by "
                               f"zerodp.initialize with expert_parallel.autoep_size={self.ep_size}) and its engine is "
                               f"closed; train it under its engine, or load engine.full_state_dict() into an "
                               f"unsplit model")
        assert self._pending is None, "a packed-experts forward started before the previous one finished"
        hidden, index, weights = self._inputs(args, dict(kwargs))
        num_experts, width = self.num_experts, hidden.shape[-1]
        top_k = index.shape[-1]
        experts = index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # pairs in expert order, then token order
        sorted_experts = experts.index_select(0, order)
        counts = torch.bincount(experts, minlength=num_experts)
        # note: a host read. Every rank sends the same slots per expert, the largest count over the group (no
        # token is dropped); the equal slices let the all-to-all be torch's all_to_all_single
        largest = counts.max().reshape(1) if experts.numel() else counts.new_zeros(1)
        comm.all_reduce(largest, self.ep_group, op=torch.distributed.ReduceOp.MAX, tag="moe capacity")
        capacity = max(int(largest), 1)
        starts = torch.cumsum(counts, 0) - counts
        slot = sorted_experts * capacity + torch.arange(experts.numel(), device=experts.device) - starts.index_select(0, sorted_experts)
        token = torch.div(order, top_k, rounding_mode="floor")
        send = hidden.new_zeros(num_experts * capacity, width).index_copy(0, slot, hidden.index_select(0, token))
        send_weights = weights.new_zeros(num_experts * capacity).index_copy(
            0, slot, weights.reshape(-1).index_select(0, order))
        # [Note: every rank's backward runs both all-to-alls] (layer.py): when anything trains, the slots stay in
        # the graph on every rank, whether or not this rank's experts got a token
        trains = torch.is_grad_enabled() and (hidden.requires_grad or weights.requires_grad or
                                              any(p.requires_grad for p in self.expert_parameters()))
        for buffer in (send, send_weights):
            if trains and not buffer.requires_grad and buffer.is_floating_point():
                buffer.requires_grad_()  # a leaf whose gradient is dropped: it only carries backward to the all-to-all
        filled = torch.zeros(num_experts * capacity, dtype=torch.uint8, device=hidden.device).index_fill_(0, slot, 1)
        filled = all_to_all(filled, self.ep_group, tag="moe slots")
        received = all_to_all(send, self.ep_group, tag="moe dispatch")
        received_weights = all_to_all(send_weights, self.ep_group, tag="moe dispatch weights")
        used = filled.nonzero().squeeze(1)  # note: a host read (which rows hold a pair)
        # received row r: slice r // (L*C) of the group, local expert (r // C) % L
        local = torch.div(used, capacity, rounding_mode="floor") % self.num_local_experts
        self._pending = _Dispatched(hidden, token, slot, received, received_weights, used, trains)
        return (received.index_select(0, used), local.unsqueeze(1),
                received_weights.index_select(0, used).unsqueeze(1)), {}

    def _combine(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        pending, self._pending = self._pending, None
        rows = pending.received * 0
        if pending.trains:
            # zeros that tie the received weights and this rank's experts into the graph: both all-to-alls'
            # backward runs on every rank ([Note: every rank's backward runs both all-to-alls] in layer.py), and
            # the packed tensors get a gradient (zero rows for experts no token reached) whenever one process
            # would give its packed tensors one, so the optimizer steps them as it steps the unsplit model's
            ties = [t.sum() * 0 for t in (pending.weights, *self.expert_parameters()) if t.requires_grad]
            if ties:
                rows = rows + sum(ties[1:], ties[0]).to(rows.dtype)
        rows = rows.index_copy(0, pending.used, output.to(rows.dtype))
        returned = all_to_all(rows, self.ep_group, tag="moe combine")
        # each token's choices summed in expert order (the pairs are sorted by expert), as one process sums them
        return torch.zeros_like(pending.hidden).index_add(0, pending.token,
                                                          returned.index_select(0, pending.slot).to(pending.hidden.dtype))


def _looks_packed(module: nn.Module) -> bool:
    """A module holding every expert's weights itself: an int `num_experts` and 3-D parameters [num_experts, ..]."""
    num = getattr(module, "num_experts", None)
    return isinstance(num, int) and not isinstance(module, MoELayer) and any(
        p.dim() == 3 and p.shape[0] == num for p in module.parameters(recurse=False))


def _why_not_splittable(module: nn.Module) -> Optional[str]:
    """None when `module` keeps transformers' experts contract (module docstring); otherwise what breaks it."""
    num = module.num_experts
    odd = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 0 or p.shape[0] != num]
    if odd:
        return f"its parameters {odd} do not lead with the expert dimension ({num})"
    nested = [n for n, _ in module.named_parameters() if "." in n]
    if nested:
        return f"it has parameters in submodules ({nested[:3]}), which zerodp cannot tell are per expert"
    names = list(inspect.signature(module.forward).parameters)[:len(INPUTS)]
    if tuple(names) != INPUTS:
        return f"its forward takes {names}, not transformers' experts arguments {list(INPUTS)}"
    return None


def find_packed_experts(model: nn.Module, ep_size: Optional[int]) -> list[PackedExperts]:
    """The packed-experts modules of `model`, to split over `ep_size` ranks (config `expert_parallel.autoep_size`;
    None: the section is not enabled, []). A model with none, or with one that breaks the contract, is a
    ConfigError naming its class; with ep_size 1 there is nothing to split ([] once checked)."""
    if ep_size is None:
        return []
    found = []
    for name, module in model.named_modules():
        if not _looks_packed(module):
            continue
        why = _why_not_splittable(module)
        if why is not None:
            raise ConfigError(f"expert_parallel.enabled: zerodp cannot split {name} ({type(module).__name__}) of "
                              f"{type(model).__name__}: {why}. Remove the expert_parallel section (every rank then "
                              f"holds every expert, stages 0-3), or build the layer with zerodp.moe.MoE(..., "
                              f"ep_size={ep_size})")
        found.append(PackedExperts(module, name, ep_size))
    if not found:
        raise ConfigError(f"expert_parallel.enabled, but {type(model).__name__} has no packed experts "
                          f"zerodp can split (a module with `num_experts` and 3-D parameters [num_experts, ...] whose "
                          f"forward takes {list(INPUTS)}, as transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE "
                          f"experts). For experts in an nn.ModuleList, build the layer with zerodp.moe.MoE(..., "
                          f"ep_size={ep_size}) (or deepspeed.moe.layer.MoE); or remove the expert_parallel section to "
                          f"keep every expert on every rank (stages 0-3)")
    return found if ep_size > 1 else []
