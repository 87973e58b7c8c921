"""The arithmetic of one gradient reduction: `GradArithmetic` (dtypes and scale factors, the same at every stage),
and, for stages 0-2, the collective that sums it: `GradCollective` (passed down to the gradient shard).

DeepSpeed's four keys, read as zerodp applies them to a flat gradient buffer `g` of one rank:

    accumulate   acc  = sum over micro-steps of g, in grad_accum_dtype           (data_types.grad_accum_dtype)
    send         s    = acc.to(communication_data_type) / pre_divisor
    reduce       r    = sum over ranks of s, in communication_data_type          (the collective)
    finish       r   /= post_divisor, then r.to(grad_accum_dtype) is this rank's reduced gradient

with the two divisors of `prescale_gradients` / `gradient_predivide_factor` (p), on N ranks:

    prescale false (default)   pre_divisor = p, post_divisor = N / p     (p = 1: sum, then divide by N)
    prescale true              pre_divisor = N, post_divisor = 1         (p is ignored, as in DeepSpeed)

DeepSpeed 0.19.8 computes the same values in slightly different steps: its engine (stage 0,
`allreduce_bucket`) and stages 1-2 with reduce_scatter=false (`gradient_reduction_w_predivide`) multiply
by 1/p before and by p/N after (prescale: by 1/N before), and stage 3 with reduce_scatter=false divides
by p and by N before and multiplies by p after; zerodp's single division on each side is the same value
up to the last bit when a divisor is not a power of two. Its stages 2 and 3 with reduce_scatter=true
refuse p != 1 and prescale (an assert), and its stage 1 with reduce_scatter=true ignores both (it
divides by N before the reduction); zerodp honours them at every stage. Both keys only change rounding
and the range the sum passes through: the result is the rank average either way.

Where the accumulation happens is the stage's policy (`grads.grad_shard.GradShard`): stages 0-1 add
micro-steps into the persistent full buffer and reduce it at the boundary; stages 2-3 reduce every
micro-step and add the reduced slice into the persistent shard. Either way the persistent tensor is in
grad_accum_dtype. A dtype of None means "the parameters' dtype" (DeepSpeed's default for both).

`torch_autocast` (zerodp/precision/autocast.py) gives some parameters their own communication dtype: the
parameters in `low_precision_ids` are summed in `low_precision_dtype`, whatever `comm_dtype` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import comm


@dataclass(frozen=True)
class GradArithmetic:
    """Dtypes and divisors of a gradient reduction over `world` ranks (module docstring)."""

    world: int                                  # ranks whose gradients are averaged
    accum_dtype: Optional[torch.dtype] = None   # persistent gradients; None: the parameters' dtype
    comm_dtype: Optional[torch.dtype] = None    # what the collective sums; None: the parameters' dtype
    predivide: float = 1.0                      # DeepSpeed's gradient_predivide_factor
    prescale: bool = False                      # DeepSpeed's prescale_gradients
    low_precision_ids: frozenset = frozenset()  # torch_autocast: id() of parameters summed in low_precision_dtype
    low_precision_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"a gradient reduction needs at least one rank, not {self.world}")
        if not self.predivide > 0:
            raise ValueError(f"gradient_predivide_factor must be positive, not {self.predivide}")

    @property
    def pre_divisor(self) -> float:
        """What each rank's gradients are divided by before the sum (1: nothing)."""
        return float(self.world) if self.prescale else float(self.predivide)

    @property
    def post_divisor(self) -> float:
        """What the sum is divided by after the reduction (1: nothing)."""
        return 1.0 if self.prescale else self.world / self.predivide

    def accum_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.accum_dtype or param_dtype

    def comm_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.comm_dtype or param_dtype

    def comm_dtype_of(self, param: torch.Tensor) -> torch.dtype:
        """The dtype `param`'s gradient is summed over ranks in."""
        if id(param) in self.low_precision_ids:
            return self.low_precision_dtype
        return self.comm_dtype_for(param.dtype)

    def to_send(self, grads: torch.Tensor, comm_dtype: torch.dtype) -> torch.Tensor:
        """`grads` as the collective sends them: in `comm_dtype` (a new tensor when it differs; else
        `grads` itself, which is then divided in place) and divided by `pre_divisor`."""
        send = grads if grads.dtype == comm_dtype else grads.to(comm_dtype)
        if self.pre_divisor != 1.0:
            send.div_(self.pre_divisor)
        return send

    def finish(self, summed: torch.Tensor) -> torch.Tensor:
        """The rank average from the collective's sum: divided by `post_divisor`, in place; returned."""
        if self.post_divisor != 1.0:
            # Divide, not multiply by the reciprocal: with p = 1 this is sum / N exactly rounded, which is
            # what a single process computes on the global batch (tests/dist/test_ddp_bitwise.py).
            summed.div_(self.post_divisor)
        return summed


class GradCollective:
    """Which collective sums a stage 0-2 bucket's flat gradient buffer over `group`, chosen once from the stage's
    policy (stage12/buckets.py `ReducePolicy`) and passed down to its gradient shard as the `reduce` it calls
    (grad_shard.py `ReduceFn`): the shard calls the collective, nothing calls back up into the bucket.

        scatter=False   all-reduce the whole buffer in place (stage 0: every rank keeps all of it)
        scatter=True    reduce-scatter: this rank's slice of the sum lands in `output` (stages 1-2);
                        `use_all_reduce`: through an all-reduce (DeepSpeed's reduce_scatter=false)
    """

    def __init__(self, group: comm.ProcessGroup, scatter: bool, use_all_reduce: bool = False) -> None:
        self.group = group
        self.scatter = scatter
        self.use_all_reduce = use_all_reduce

    def __call__(self, output: torch.Tensor, full: torch.Tensor, async_op: bool) -> comm.Handle:
        if not self.scatter:
            return comm.all_reduce(full, self.group, async_op=async_op, tag="grad")
        return comm.reduce_scatter(output, full, self.group, async_op=async_op, use_all_reduce=self.use_all_reduce,
                                   tag="grad")
