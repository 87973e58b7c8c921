"""`ForwardEngine`: what `deepspeed.initialize(model=m, config=c)` returns when there is nothing to train
with (no optimizer argument, no `optimizer` section): the model for forward passes only, e.g. the frozen
reference model of DeepSpeed-Chat's DPO step.

DeepSpeed builds the same engine as for training, minus the optimizer: the module is cast to the config's
compute dtype (bf16/fp16) and its forward runs unchanged (inputs are not cast, as with the training engine
under bf16). At stages 0-2 every rank holds the whole model, placed on the accelerator, which is what this
engine does.

At stage 3 the parameters stay sharded, as DeepSpeed's are: the engine lays the module out with the training
engine's stage-3 strategy (`stage3.build_stage3_sharding(..., forward_only=True)`), so each forward gathers
the module units just in time and frees them after, and in eval mode under no_grad the inference cache
(stage3/inference_cache.py) may keep them between forwards. Every parameter is laid out as frozen: no gradient
buffer, no reduction, no optimizer state; parameters under `stage3_param_persistence_threshold` stay whole.
Under NCCL a model built on the CPU is moved to cuda:LOCAL_RANK first, as the training engine does
([Note: a CPU-built model under NCCL] in zerodp/comm/module_device.py); a model built
under `zero.Init` (HfDeepSpeedConfig at stage 3) is taken over shard by shard, one built whole starts from rank
0's weights, as DeepSpeed's partitioning broadcasts them. The stage-3 forward runs under `torch.no_grad()`:
its outputs carry no graph. That changes no gradient anything can use (DeepSpeed's graph would only reach
this engine's own parameters, which nothing steps), and keeps autograd from holding gathered storage that the
forward frees.

`backward` and `step` are refused at every stage: nothing would update the weights.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ... import comm
from ...comm import launch_env
from ...config import ZeroConfig
from ...comm.module_device import place_module
from ...precision.policy import PrecisionPolicy
from ...engine.preflight import broadcast_module_state, check_same_model
from ...shard.stage3 import Stage3Sharding, build_stage3_sharding
from .accelerator import get_accelerator


class ForwardEngine:
    """A model in the compute dtype, with DeepSpeed's engine surface for forwards; sharded at stage 3."""

    def __init__(self, module: nn.Module, config: ZeroConfig, process_group: comm.ProcessGroup = None) -> None:
        self.module = module
        self.config = config
        dtype = PrecisionPolicy.from_config(config).param_dtype
        # stage 3: the training engine's strategy with every parameter frozen (see the module docstring)
        self.sharding: Optional[Stage3Sharding] = None
        if config.stage == 3:
            place_module(module, process_group)  # NCCL: CPU tensors to cuda:LOCAL_RANK (zerodp/comm/module_device.py)
            check_same_model(module, process_group)
            broadcast_module_state(module, process_group)  # skips parameters built sharded (equal already)
            module.to(dtype=dtype)  # whole tensors only: parameters built sharded are in this dtype already
            self.sharding = build_stage3_sharding(module, [], config, process_group, forward_only=True)
            return
        device = torch.device(get_accelerator().device_name(launch_env.local_rank()))
        # DeepSpeed casts the whole module (parameters and floating buffers) to the half dtype, then moves it
        module.to(device=device, dtype=dtype)

    def __call__(self, *args, **kwargs):
        if self.sharding is None:
            return self.module(*args, **kwargs)
        with torch.no_grad():  # stage 3: no graph over storage the forward frees (module docstring)
            return self.module(*args, **kwargs)

    forward = __call__

    def close(self) -> None:
        """Stage 3: remove the gather hooks and the parameter registry's entries (the parameters stay sharded;
        the engine cannot run forwards after). Idempotent; nothing to release at stages 0-2."""
        if self.sharding is not None:
            self.sharding.close()  # idempotent itself

    def _no_optimizer(self, what: str):
        raise RuntimeError(f"engine.{what}(): this engine was made by deepspeed.initialize without an optimizer "
                           f"(forward passes only); pass optimizer=... or an 'optimizer' config section to train it")

    def backward(self, loss: torch.Tensor, **unused) -> None:
        self._no_optimizer("backward")

    def step(self, lr_kwargs=None) -> None:
        self._no_optimizer("step")

    def train(self, mode: bool = True) -> "ForwardEngine":
        self.module.train(mode)
        if mode and self.sharding is not None:
            self.sharding.release_kept_units()  # units kept gathered between eval forwards (inference_cache.py)
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
