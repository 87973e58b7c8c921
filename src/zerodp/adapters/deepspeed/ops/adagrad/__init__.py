"""`deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`, as torch's Adagrad (the same update).

Accelerate builds it in place of a torch Adagrad whenever offload_optimizer is on (`map_pytorch_optim_to_deepspeed`),
over that optimizer's param groups. DeepSpeed's CPU Adagrad: g <- g + wd p, s <- s + g^2, p <- p - lr g / (sqrt(s) +
eps), which is torch's Adagrad with lr_decay 0 and initial_accumulator_value 0. Like DeepSpeedCPUAdam, a function
returning the torch optimizer: zerodp runs it where its offload config puts the state.
"""

from __future__ import annotations

import torch

__all__ = ["DeepSpeedCPUAdagrad"]


def DeepSpeedCPUAdagrad(model_params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,  # noqa: N802
                        amsgrad: bool = False, fp32_optimizer_states: bool = True) -> torch.optim.Adagrad:
    """DeepSpeed's CPU Adagrad (amsgrad is refused, as DeepSpeed refuses it)."""
    if amsgrad:
        raise ValueError("DeepSpeedCPUAdagrad does not support the AMSGrad variant (DeepSpeed refuses it too)")
    if not fp32_optimizer_states:
        raise ValueError("DeepSpeedCPUAdagrad(fp32_optimizer_states=False) is not supported by zerodp: its optimizer "
                         "states are fp32; remove the argument")
    return torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
