"""Mixed-precision policy and the dynamic loss scaler.

With bf16 or fp16 the model computes in the low precision (parameters, activations and gradients
are 2 bytes each) while the optimizer steps an fp32 master copy of each rank's shard. fp16 needs a
loss scale so that small gradients do not flush to zero; the scale is lowered when any rank sees an
inf/nan gradient (that step is skipped everywhere) and raised after `loss_scale_window` clean steps.
Gradients are summed over ranks in `reduce_dtype` and accumulated over micro-steps in
`grad_accum_dtype` (DeepSpeed's communication_data_type and data_types.grad_accum_dtype; both the
compute dtype unless configured): see grads/grad_arithmetic.py for the exact arithmetic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import ZeroConfig

log = logging.getLogger("zerodp")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each kind of tensor uses."""

    param_dtype: torch.dtype   # model parameters, activations and gradients
    master_dtype: torch.dtype = torch.float32
    reduce_dtype: Optional[torch.dtype] = None      # gradients summed over ranks in; None: param_dtype
    grad_accum_dtype: Optional[torch.dtype] = None  # gradients accumulated over micro-steps in; None: param_dtype

    @property
    def mixed(self) -> bool:
        """True when the optimizer steps a separate fp32 master copy."""
        return self.param_dtype != self.master_dtype

    @classmethod
    def from_config(cls, config: ZeroConfig) -> "PrecisionPolicy":
        param = torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else torch.float32
        return cls(param, reduce_dtype=DTYPES.get(config.communication_data_type),
                   grad_accum_dtype=DTYPES.get(config.data_types.grad_accum_dtype))


# The config's dtype names (config/precision.py canonicalizes DeepSpeed's spellings to these).
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class LossScaler:
    """A loss scale: static, dynamic (fp16), or the identity (fp32/bf16).

    Call `update(overflow)` once per optimizer step with the all-ranks overflow flag.
    """

    def __init__(self, scale: float = 1.0, dynamic: bool = False, window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, factor: float = 2.0) -> None:
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window, self.hysteresis, self.consecutive_hysteresis = window, hysteresis, consecutive_hysteresis
        self.min_scale, self.factor = min_scale, factor
        self._hysteresis_left = hysteresis
        self._clean_steps = 0
        self.overflows = 0

    @classmethod
    def from_config(cls, config: ZeroConfig) -> "LossScaler":
        fp16 = config.fp16
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale > 0:
            return cls(scale=fp16.loss_scale)
        return cls(scale=2.0 ** fp16.initial_scale_power, dynamic=True, window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                   min_scale=fp16.min_loss_scale)

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step; `overflow` must be the same on every rank."""
        if overflow:
            self.overflows += 1
            self._clean_steps = 0
            if not self.dynamic:
                log.warning("zerodp: gradient overflow with static loss scale %g; step skipped", self.scale)
                return
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
                return
            if self.scale <= self.min_scale:
                log.warning("zerodp: gradient overflow at the minimum loss scale %g; step skipped. Persistent "
                            "overflow at the minimum means the model diverges in fp16: lower the learning rate "
                            "or use bf16", self.scale)
            self.scale = max(self.scale / self.factor, self.min_scale)
            return
        if not self.dynamic:
            return
        self._clean_steps += 1
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if self._clean_steps > 0 and self._clean_steps % self.window == 0:  # -1 then 0: a DeepSpeed checkpoint
            # saved right after an overflow (checkpoint/deepspeed_reader.loss_scaler_state)
            self._hysteresis_left = self.hysteresis
            self.scale *= self.factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left,
                "clean_steps": self._clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])


def cast_floats(obj, dtype: torch.dtype):
    """`obj` (tensors in lists, tuples, named tuples and dicts) with every floating tensor cast to `dtype`:
    a mixed-precision model's inputs, as the engine's forward receives them."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        cast = [cast_floats(o, dtype) for o in obj]
        return type(obj)(cast) if not hasattr(obj, "_fields") else type(obj)(*cast)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj
