"""`deepspeed.runtime.zero.offload_config`: the two enums scripts import from it.

`OffloadDeviceEnum` names where ZeRO keeps offloaded tensors (the config's `offload_optimizer.device` /
`offload_param.device` values); `OffloadStateTypeEnum` names the engine states that
`engine.offload_states(include=...)` moves (DeepSpeedExamples' training/offload_states). Values are
DeepSpeed's, so `OffloadStateTypeEnum["optim_states"]` and `OffloadDeviceEnum("cpu")` work as there.
What `offload_states` does on zerodp's devices is in zerodp.deepspeed.engine.
"""

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where offloaded tensors live."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The engine states `offload_states` can move (DeepSpeed's names for them)."""

    optim_states = "optim_states"  # the optimizer's elementwise state (Adam's moments)
    hp_params = "hp_params"  # the fp32 master copy of the parameters
    lp_params = "lp_params"  # the compute-dtype (bf16/fp16) parameters
    lp_grads = "lp_grads"  # the compute-dtype gradients
    contiguous_grad_buffer = "contiguous_grad_buffer"  # the gradient reduction buffers
