"""`deepspeed.ops.adam.FusedAdam` and `DeepSpeedCPUAdam`, as the torch optimizers with the same update.

Both names build what the config's `"type": "Adam"` builds in zerodp (`optim.deepspeed_types`):
`torch.optim.AdamW` (adam_w_mode / adamw_mode true, DeepSpeed's default: decoupled weight decay) or
`torch.optim.Adam` (false: L2), and zerodp's `FusedAdam` for `bias_correction=False`, which torch lacks.
They are functions returning an optimizer, so `isinstance(opt, FusedAdam)` is not available. CPU
offload is not implemented in zerodp: DeepSpeedCPUAdam is the same update, run where the parameters are.
"""

from __future__ import annotations

from .....optimizers.deepspeed_types import _adam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


def FusedAdam(params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),  # noqa: N802
              eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
              set_grad_none: bool = True):
    """DeepSpeed's FusedAdam (amsgrad is refused, as DeepSpeed refuses it)."""
    if amsgrad:
        raise RuntimeError("FusedAdam does not support the AMSGrad variant (DeepSpeed refuses it too)")
    return _adam("adam", dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                              adam_w_mode=adam_w_mode, weight_decay=weight_decay), params)


def DeepSpeedCPUAdam(model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),  # noqa: N802
                     eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, adamw_mode: bool = True,
                     fp32_optimizer_states: bool = True):
    """DeepSpeed's CPU Adam (amsgrad is refused, as DeepSpeed refuses it)."""
    if amsgrad:
        raise ValueError("DeepSpeedCPUAdam does not support the AMSGrad variant (DeepSpeed refuses it too)")
    if not fp32_optimizer_states:
        raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported by zerodp: its optimizer "
                         "states are fp32; remove the argument")
    return _adam("adam", dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                              adam_w_mode=adamw_mode, weight_decay=weight_decay), model_params)
