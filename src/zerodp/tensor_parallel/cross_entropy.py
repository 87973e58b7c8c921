"""Cross entropy over logits whose vocabulary is split across the tensor-parallel group (Megatron's
`vocab_parallel_cross_entropy`): no rank ever holds a whole row of logits.

For one row z split in parts z_t (rank t holds vocabulary ids [t V/tp, (t+1) V/tp)):
    m = max_t max(z_t)          one all-reduce (MAX), for a stable exp
    S = sum_t sum(exp(z_t - m)) one all-reduce (SUM)
    z_y                         the target's logit, from the rank that holds it (an all-reduce SUM of zeros elsewhere)
    loss = log S - (z_y - m)    and its gradient on rank t: softmax(z)_t - onehot(y)_t
Computed in fp32. Depends on torch only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group):
        logits = logits.float()
        rank = 0 if group is None else dist.get_rank(group)
        per_rank = logits.size(-1)
        start = rank * per_rank
        row_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        outside = (targets < start) | (targets >= start + per_rank)
        local = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce(target_logit, group)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), (~outside).to(g.dtype).neg().unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Per-position loss (shape of `targets`) from this rank's vocabulary slice of the logits ([..., V / tp])."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
