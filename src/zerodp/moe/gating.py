"""The top-k gate of a mixture-of-experts layer: `TopKGate` and the `Routing` it decides (GShard's gating, with
DeepSpeed's `deepspeed.moe.sharded_moe` meaning of every option).

For S tokens, E experts and a capacity of C slots per expert, the gate (a bias-free Linear, computed in fp32)
gives softmax probabilities `gates` [S, E]; each token's top-1 (and, for k = 2, top-2) expert is picked; each
expert keeps its first C tokens in token order (first choices before second choices) and drops the rest:

    capacity C   drop_tokens:  max(ceil(S / E * capacity_factor * k), min_capacity)   (eval: eval_capacity_factor)
                 otherwise:    the largest expert count over the expert-parallel group (nothing is dropped)
    combine      [S, E, C]: a kept token's weight in its expert's slot. k = 1: its gate probability;
                 k = 2: the two kept probabilities renormalized to sum to 1 (DeepSpeed's rule)
    l_aux        the load-balancing loss, over this rank's tokens:  k = 1: E * sum_e mean_s(gates) * frac_e
                 k = 2: E^2 * mean_e(mean_s(gates) * frac_e), frac_e = share of tokens whose FIRST choice is e

Randomness, as DeepSpeed: use_rts (random token selection) chooses which tokens an over-full k = 1 expert keeps
by uniform noise from torch's generator (without it, topk over equal values: which ones is the kernel's
choice, as in DeepSpeed; k = 2 keeps the first in token order, first choices first), and k = 2 with `top2_2nd_expert_sampling` adds Gumbel noise to the logits
before the second choice. noisy_gate_policy 'Jitter' scales the gate's input by uniform noise in [1-1e-2,
1+1e-2], 'RSample' adds Gumbel noise to the logits for the top-1 choice; all only in training.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


class Routing(NamedTuple):
    """Where the gate sends this rank's tokens."""

    combine: torch.Tensor      # [S, E, C] fp32: a kept token's weight in its slot (0 elsewhere)
    dispatch: torch.Tensor     # [S, E, C] bool: combine != 0
    l_aux: torch.Tensor        # the load-balancing loss (a scalar with a graph to the gate)
    exp_counts: torch.Tensor   # [E] tokens choosing each expert, before capacity drops (no graph)
    capacity: int              # C


def _gumbel(shape, device) -> torch.Tensor:
    uniform = torch.rand(shape, device=device).clamp_(min=1e-20)
    return -torch.log(-torch.log(uniform) + 1e-20)


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert when tokens are dropped: max(ceil(S / E * factor), min_capacity)."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor), min_capacity)


def _keep_within_capacity(mask: torch.Tensor, capacity: int, use_rts: bool) -> torch.Tensor:
    """mask [S, E] 0/1, each column cut to `capacity` tokens by `topk`: of uniform noise (use_rts), or of the mask
    itself, where topk's kernel chooses among the equal values (DeepSpeed's call, so the same tokens on one torch)."""
    scores = mask * torch.rand(mask.shape, device=mask.device) if use_rts else mask
    keep = torch.topk(scores, k=min(capacity, mask.shape[0]), dim=0).indices
    return mask * torch.zeros_like(mask).scatter_(0, keep, 1)


def _largest_count(counts: torch.Tensor, ep_group: comm.ProcessGroup) -> int:
    """drop_tokens=False: every rank of the expert-parallel group sends the same slots, the largest count."""
    largest = counts.max().reshape(1).clone()
    if ep_group is not None and comm.get_world_size(ep_group) > 1:
        comm.all_reduce(largest, ep_group, op=torch.distributed.ReduceOp.MAX, tag="moe capacity")
    return int(largest)  # note: a host read, as DeepSpeed's capacity (the buffers' shape depends on it)


def top1_routing(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool,
                 use_rts: bool, noisy_gate_policy: Optional[str], ep_group: comm.ProcessGroup,
                 used_token: Optional[torch.Tensor] = None) -> Routing:
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    choose_from = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask = F.one_hot(torch.argmax(choose_from, dim=1), num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(_largest_count(exp_counts, ep_group), num_tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    if num_tokens < min_capacity:
        raise ValueError(f"the MoE gate got {num_tokens} tokens, fewer than min_capacity={min_capacity}: lower "
                         f"min_capacity (0 is allowed) or give the layer more tokens per rank")
    mask = _keep_within_capacity(mask, capacity, use_rts)
    slot = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(dim=1)
    weights = gates * mask.float()
    combine = weights.unsqueeze(2) * F.one_hot(slot, num_classes=capacity).float().unsqueeze(1)
    return Routing(combine, combine.bool(), l_aux, exp_counts, capacity)


def top2_routing(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool,
                 second_sampling: bool, ep_group: comm.ProcessGroup) -> Routing:
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    noisy = logits + _gumbel(logits.shape, logits.device) if second_sampling else logits
    mask2 = F.one_hot(torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1), num_classes=num_experts)
    slot1 = torch.cumsum(mask1, dim=0) - 1
    slot2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second choices queue after the first
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (slot1 < capacity)
        mask2 = mask2 * (slot2 < capacity)
    else:
        capacity = _largest_count(exp_counts, ep_group)
    gate1 = (gates * mask1.float()).sum(dim=1)
    gate2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(gate1 + gate2, min=torch.finfo(gates.dtype).eps)
    combine = torch.zeros(num_tokens, num_experts, capacity, dtype=gates.dtype, device=gates.device)
    for gate, mask, slot in ((gate1 / denom, mask1, slot1), (gate2 / denom, mask2, slot2)):
        weights = gate.unsqueeze(1) * mask.float()
        combine = combine + weights.unsqueeze(2) * F.one_hot((slot * mask).sum(dim=1), capacity).float().unsqueeze(1)
    return Routing(combine, combine.bool(), l_aux, exp_counts, capacity)


class TopKGate(nn.Module):
    """The gate: a bias-free Linear(model_dim, num_experts) read in fp32, and the routing options (module docstring)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"k={k}: the MoE gate routes each token to its top 1 or top 2 experts; use k=1 or k=2")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}: use one of {NOISY_GATE_POLICIES}")
        if k == 2 and noisy_gate_policy not in (None, "None"):
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r} applies to k=1 only (DeepSpeed ignores it "
                             f"at k=2); leave it None with k=2")
        if min_capacity < 0 or capacity_factor <= 0 or eval_capacity_factor <= 0:
            raise ValueError("capacity_factor and eval_capacity_factor must be > 0 and min_capacity >= 0")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.num_experts = k, num_experts
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling

    def forward(self, tokens: torch.Tensor, ep_group: comm.ProcessGroup = None,
                used_token: Optional[torch.Tensor] = None) -> Routing:
        """Route `tokens` [S, model_dim]; `ep_group`: where drop_tokens=False agrees on the capacity."""
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1_routing(logits, factor, self.min_capacity, self.drop_tokens, self.use_rts,
                                self.noisy_gate_policy if self.training else None, ep_group, used_token)
        if used_token is not None:
            raise ValueError("used_token is read by the k=1 gate only (as DeepSpeed's); pass None with k=2")
        return top2_routing(logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling,
                            ep_group)
