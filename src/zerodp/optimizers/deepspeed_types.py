"""DeepSpeed's `optimizer: {type, params}` with DeepSpeed's meaning for every type and parameter.

    Adam / AdamW   adam_w_mode (default true: decoupled weight decay, as DeepSpeed's FusedAdam;
                   type AdamW is always decoupled), bias_correction, torch_adam (a kernel choice:
                   same update), amsgrad only with torch_adam (FusedAdam refuses it). FusedAdam's
                   weight_decay default is 0 (torch's AdamW default 0.01 applies only with torch_adam).
    Lamb           DeepSpeed's FusedLamb update (`fused_lamb`): bias_correction, eps_inside_sqrt,
                   max_coeff, min_coeff; max_grad_norm is refused (use gradient_clipping).
    Adagrad, and any torch.optim class by name (SGD, RMSprop, ...): torch's class, as DeepSpeed does.
    OneBitAdam, ZeroOneAdam, OneBitLamb: refused (DeepSpeed asserts they do not run with ZeRO either).
    Lion: DeepSpeed's Lion update (`lion.Lion`), by name as any class above.
    MuAdam, MuAdamW, MuSGD: refused (not implemented in zerodp).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .fused_adam import FusedAdam
from .fused_lamb import FusedLamb

_REFUSED = {
    "onebitadam": "1-bit Adam does not run with ZeRO (DeepSpeed asserts the same); use Adam",
    "zerooneadam": "0/1 Adam does not run with ZeRO (DeepSpeed asserts the same); use Adam",
    "onebitlamb": "1-bit LAMB does not run with ZeRO (DeepSpeed asserts the same); use Lamb",
    "muadam": "mup's MuAdam is not implemented in zerodp; pass a mup optimizer object with "
              "zero_allow_untested_optimizer: true",
    "muadamw": "mup's MuAdamW is not implemented in zerodp; pass a mup optimizer object with "
               "zero_allow_untested_optimizer: true",
    "musgd": "mup's MuSGD is not implemented in zerodp; pass a mup optimizer object with "
             "zero_allow_untested_optimizer: true",
}


def check_no_auto(section_type: str, params: dict) -> None:
    """Refuse "auto" optimizer params: only an integration such as HF's Trainer can fill them in."""
    autos = sorted(k for k, v in params.items() if v == "auto")
    if autos:
        from ..errors import OptimizerError

        raise OptimizerError(f"optimizer ({section_type}) params {', '.join(autos)} are 'auto', which the HF Trainer "
                             f"fills in from its arguments; write values (DeepSpeed's defaults: lr 1e-3, betas "
                             f"[0.9, 0.999], eps 1e-8, weight_decay 0)")


def build_deepspeed_type(section_type: str, params: dict, model_params) -> Optional[torch.optim.Optimizer]:
    """The optimizer DeepSpeed builds for `section_type`, or None when the name is not one of DeepSpeed's own."""
    from ..errors import OptimizerError

    name = section_type.lower()
    if name in _REFUSED:
        raise OptimizerError(f"optimizer type '{section_type}': {_REFUSED[name]}")
    params = dict(params)
    try:
        if name in ("adam", "adamw"):
            return _adam(name, params, model_params)
        if name == "lamb":
            if params.pop("amsgrad", False):
                raise OptimizerError("optimizer Lamb: amsgrad is not supported (DeepSpeed's FusedLamb refuses it too)")
            return FusedLamb(model_params, **params)
    except TypeError as err:
        raise OptimizerError(f"optimizer {section_type}: bad params {sorted(params)}: {err}") from None
    return None


def _adam(name: str, params: dict[str, Any], model_params) -> torch.optim.Optimizer:
    from ..errors import OptimizerError

    torch_adam = bool(params.pop("torch_adam", False))
    # DeepSpeed: type Adam means AdamW-style decoupled decay unless adam_w_mode is false; AdamW always is.
    decoupled = name == "adamw" or bool(params.pop("adam_w_mode", True))
    params.pop("adam_w_mode", None)
    bias_correction = bool(params.pop("bias_correction", True))
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)  # FusedAdam's default (torch's AdamW would use 0.01)
        if params.get("amsgrad"):
            raise OptimizerError("optimizer Adam: amsgrad needs 'torch_adam': true (DeepSpeed's FusedAdam refuses it)")
        params.pop("amsgrad", None)
    if not bias_correction:
        if torch_adam:
            raise OptimizerError("optimizer Adam: bias_correction is a FusedAdam parameter; remove torch_adam or "
                                 "bias_correction (DeepSpeed passes it to torch's Adam, which refuses it)")
        return FusedAdam(model_params, bias_correction=False, adam_w_mode=decoupled, **params)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(model_params, **params)
