"""Optimizers that stay exact on ZeRO's flat shards, and how zerodp rebuilds the user's optimizer.

Modules:
    checkpoint_state.py  What checkpoints read and set of the sharded optimizer (`seams.CheckpointOptimizer`), per unit.
    chunk_pieces.py      Each unit's parameters cut at its optimizer chunks, computed once: `ChunkPieces`.
    grad_staging.py      Reduced gradient shards copied into pinned host buffers as they become final: `GradStaging` ...
    inner.py             Building the inner optimizer: from DeepSpeed's `optimizer` section, and again on master shards.
    late_starters.py     Parameters whose gradient came after a step they missed, under an optimizer without ...
    model_parallel.py    ZeRO beside tensor parallelism: the gradient norm and the overflow flag over the whole 2-D ...
    optimizer.py         The sharded optimizer: fp32 master shards, the inner optimizer, clipping, the step, parameter ...
    shared_groups.py     The user's param groups are the inner optimizer's groups: one dict per group, shared.
    slice_steps.py       torch's update of slices of flat chunks, each with its own step count: `SliceSteps`.
    step_counts.py       Per-parameter step counts for Adam-family optimizers stepped over flat chunks: `StepCounts`.
    step_kernel.py       Which torch implementation steps zerodp's flat fp32 masters: `master_step_settings`.
    step_path.py         Which gradients one optimizer step reads, chosen once: `StepPath` (bound, or transient).
    step_plan.py         How one optimizer step walks this rank's chunks: `StepPlan`, the only place that knows what is ...
    transient_grads.py   Mixed-precision steps whose fp32 copies of the gradients exist one window of units at a time.
"""

import sys as _sys

from . import optimizer
from ..optimizers.lamb import LAMB
from ..optimizers.larc import LARC
from ..optimizers.fused_adam import FusedAdam
from ..optimizers.fused_lamb import FusedLamb
from .inner import register_whole_tensor
from ..optimizers.lion import Lion
from ..optimizers.optimizer_list import OptimizerList

# The former module path `zerodp.optimizer` stays importable (code written before the layout change).
_sys.modules.setdefault("zerodp.optimizer", optimizer)
setattr(_sys.modules["zerodp"], "optimizer", optimizer)

__all__ = ["LARC", "LAMB", "FusedAdam", "FusedLamb", "Lion", "OptimizerList", "register_whole_tensor"]
