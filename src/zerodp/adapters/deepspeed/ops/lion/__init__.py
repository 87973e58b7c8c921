"""`deepspeed.ops.lion.DeepSpeedCPULion` and `FusedLion`, as zerodp's Lion (optim/lion.py: DeepSpeed's update).

Accelerate builds DeepSpeedCPULion in place of bitsandbytes' 32-bit Lion whenever offload_optimizer is on
(`map_pytorch_optim_to_deepspeed`), over that optimizer's param groups. Functions returning the optimizer, as
`deepspeed.ops.adam`'s are.
"""

from __future__ import annotations

from .....optimizers.lion import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


def DeepSpeedCPULion(model_params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0,  # noqa: N802
                     fp32_optimizer_states: bool = True) -> Lion:
    """DeepSpeed's CPU Lion."""
    if not fp32_optimizer_states:
        raise ValueError("DeepSpeedCPULion(fp32_optimizer_states=False) is not supported by zerodp: its optimizer "
                         "states are fp32; remove the argument")
    return Lion(model_params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def FusedLion(params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,  # noqa: N802
              set_grad_none: bool = True) -> Lion:
    """DeepSpeed's fused (GPU) Lion: the same update."""
    return Lion(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
