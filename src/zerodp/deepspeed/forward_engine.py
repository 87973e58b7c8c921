"""`ForwardEngine`: what `deepspeed.initialize(model=m, config=c)` returns when there is nothing to train
with (no optimizer argument, no `optimizer` section): the model for forward passes only, e.g. the frozen
reference model of DeepSpeed-Chat's DPO step.

DeepSpeed builds the same engine as for training, minus the optimizer: the module is cast to the config's
compute dtype (bf16/fp16) and placed on the accelerator, and its forward runs unchanged (inputs are not
cast, as with the training engine under bf16). At stages 0-2 every rank holds the whole model, which is what
this engine does. Stage 3 partitions the parameters for inference in DeepSpeed (ZeRO-Offload's parameter
manager); zerodp's stage 3 lives in its training engine, so a forward-only stage-3 engine is refused when
built, naming the way out. `backward` and `step` are refused too: nothing would update the weights.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..config import ConfigError, ZeroConfig
from ..precision import PrecisionPolicy
from .accelerator import get_accelerator


class ForwardEngine:
    """A model in the compute dtype on this rank's device, with DeepSpeed's engine surface for forwards."""

    def __init__(self, module: nn.Module, config: ZeroConfig) -> None:
        if config.stage == 3:
            raise ConfigError("deepspeed.initialize without an optimizer at ZeRO stage 3 (DeepSpeed's partitioned "
                              "inference engine) is not implemented in zerodp; use stage 0-2 in this model's config "
                              "(every rank then holds the whole model) or pass an optimizer")
        self.module = module
        self.config = config
        dtype = PrecisionPolicy.from_config(config).param_dtype
        device = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))
        # DeepSpeed casts the whole module (parameters and floating buffers) to the half dtype, then moves it
        module.to(device=device, dtype=dtype)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def _no_optimizer(self, what: str):
        raise RuntimeError(f"engine.{what}(): this engine was made by deepspeed.initialize without an optimizer "
                           f"(forward passes only); pass optimizer=... or an 'optimizer' config section to train it")

    def backward(self, loss: torch.Tensor, **unused) -> None:
        self._no_optimizer("backward")

    def step(self, lr_kwargs=None) -> None:
        self._no_optimizer("step")

    def train(self, mode: bool = True) -> "ForwardEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ForwardEngine":
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    @property
    def optimizer(self):
        return None

    @property
    def lr_scheduler(self):
        return None

    def zero_optimization_stage(self) -> int:
        return self.config.stage

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def __getattr__(self, name: str):
        # DeepSpeed's engine answers with the module's attributes for names it lacks
        try:
            return getattr(self.__dict__["module"], name)
        except (AttributeError, KeyError):
            raise AttributeError(f"'ForwardEngine' object has no attribute {name!r}") from None
