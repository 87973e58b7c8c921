"""Non-finite gradients in bf16/fp32 training: detected on every rank at once, then stop or skip.

Detection costs no extra collective. The global gradient norm that clipping needs is already
computed from every rank's shard (stages 1-3: an all-reduce of squared norms; stage 0: every rank
holds the same all-reduced gradients), so one NaN or Inf anywhere makes the norm non-finite on
every rank, in the same step. Without this check the NaN would pass clipping (`min(1, c / nan)` is
1 in Python) and the optimizer would write it into every master: every parameter on every rank
would become NaN, silently.

Policy (config key `nonfinite`):
    stop  raise `NonFiniteError` on every rank, naming the step, the rank(s) whose loss was not
          finite and the first parameter whose reduced gradient was not finite; nothing is written.
    skip  skip the step on every rank with a warning; `engine.nonfinite_steps` counts them.
fp16 keeps its own rule (the dynamic loss scaler skips the step and lowers the scale).
Diagnosis runs only after detection, so its collective (an object all-gather) is off the hot path.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .. import comm
from ..config import NonFinitePolicy
from ..errors import ConfigError, NonFiniteError

__all__ = ["NonFiniteError", "NonFinitePolicy", "check_hyperparameters", "describe"]


def check_hyperparameters(param_groups: Sequence[dict], where: str = "the optimizer") -> None:
    """Refuse a NaN or infinite float hyper-parameter (lr, weight_decay, betas, ...) in any group."""
    for i, group in enumerate(param_groups):
        for key, value in group.items():
            values = value if isinstance(value, (tuple, list)) and key != "params" else (value,)
            for v in values:
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{where}'s param group {i} has {key}={value}; "
                                     f"use a finite value (a NaN or infinite {key} would make every parameter NaN)")


def first_nonfinite_parameter(units, names: dict[int, list[str]]) -> Optional[str]:
    """Name of the first parameter (units in order) whose part of this rank's gradient shard is not finite.
    Offloaded gradient shards are read one at a time."""
    for unit in units:
        with unit.grad_resident():
            name = _first_nonfinite_in(unit, unit.grad_shard, names)
        if name is not None:
            return name
    return None


def _first_nonfinite_in(unit, grad: torch.Tensor, names: dict[int, list[str]]) -> Optional[str]:
    if grad.numel() > 0 and not bool(torch.isfinite(grad).all()):
        for seg in unit.layout.segments(unit.shard_index):
            piece = grad[seg.shard_start:seg.shard_start + seg.numel]
            if not bool(torch.isfinite(piece).all()):
                param = unit.params[seg.param_index]
                return names.get(id(param), [f"<parameter {seg.param_index} of unit {unit!r}>"])[0]
    return None


def describe(step: int, norm: float, loss_finite: bool, units, names: dict[int, list[str]],
             process_group: comm.ProcessGroup) -> str:
    """One message, the same on every rank: which ranks' losses and which parameter were not finite.

    Every rank must call it (it gathers each rank's findings); it only runs after detection.
    """
    mine = (comm.get_rank(process_group), loss_finite, first_nonfinite_parameter(units, names))
    found = comm.all_gather_object(mine, process_group)
    bad_loss = [r for r, finite, _ in found if not finite]
    first = next(((r, name) for r, _, name in found if name is not None), None)
    parts = [f"non-finite gradient norm ({norm}) at optimizer step {step + 1}"]
    if bad_loss:
        parts.append(f"the loss was not finite on rank {', '.join(map(str, bad_loss))}")
    if first is not None:
        parts.append(f"first parameter with a non-finite gradient: '{first[1]}' (in rank {first[0]}'s shard)")
    return "; ".join(parts)
