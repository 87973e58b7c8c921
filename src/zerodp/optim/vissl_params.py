"""VISSL's parameter groups and optimizer, rebuilt over a plain PyTorch model.

VISSL's default param-group rule, per module:
    Linear / Conv            weight: regularized; bias: regularized iff regularize_bias
    BatchNorm / SyncBN / LN  weight: regularized iff regularize_bn;
                             bias: regularized iff regularize_bn and regularize_bias
    any other module         its own parameters: regularized
    names containing an entry of non_regularized_parameters: never regularized
Regularized parameters get the configured weight decay, the others weight_decay = 0. With
construct_single_param_group_only every trainable parameter is in one regularized group.
(VISSL keeps trunk and head in separate groups; with equal lr and weight decay, as here, the update
is the same, so zerodp keeps two groups.)
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from .larc import LARC

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm)


def vissl_param_groups(model: nn.Module, regularize_bn: bool, regularize_bias: bool,
                       non_regularized: list[str], single_group: bool) -> tuple[list, list]:
    """(regularized, unregularized) trainable parameters, by VISSL's rule."""
    if single_group:
        return [p for p in model.parameters() if p.requires_grad], []
    regularized, unregularized = [], []
    for module in model.modules():
        if isinstance(module, _CONV):
            regularized.append(module.weight)
            if module.bias is not None:
                (regularized if regularize_bias else unregularized).append(module.bias)
        elif isinstance(module, _NORM):
            if module.weight is not None:
                (regularized if regularize_bn else unregularized).append(module.weight)
            if module.bias is not None:
                (regularized if regularize_bn and regularize_bias else unregularized).append(module.bias)
        else:
            regularized.extend(module.parameters(recurse=False))
    if non_regularized:
        names = {id(p): n for n, p in model.named_parameters()}
        moved = [p for p in regularized if any(s in names[id(p)] for s in non_regularized)]
        regularized = [p for p in regularized if all(p is not q for q in moved)]
        unregularized += moved
    seen: set[int] = set()

    def keep(params):  # trainable only, each parameter once (tied weights appear in several modules)
        out = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    return keep(regularized), keep(unregularized)


def build_vissl_optimizer(model: nn.Module, spec: dict, lr: float):
    """SGD (LARC-wrapped if spec['larc']), Adam or AdamW over VISSL's param groups at learning rate `lr`."""
    regularized, unregularized = vissl_param_groups(model, spec["regularize_bn"], spec["regularize_bias"],
                                                    spec["non_regularized_parameters"], spec["single_group"])
    groups = [{"params": regularized, "weight_decay": spec["weight_decay"]},
              {"params": unregularized, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError("VISSL config: the model has no trainable parameters")
    name = spec["name"]
    if name == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=spec["momentum"], nesterov=spec["nesterov"])
    elif name == "adam":
        opt = torch.optim.Adam(groups, lr=lr, betas=tuple(spec["betas"]))
    elif name == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(spec["betas"]))
    else:  # vissl_resolve validates the name first; this guards direct callers
        raise ConfigError(f"VISSL config: optimizer '{name}' is not supported")
    return LARC(opt, **spec["larc"]) if spec["larc"] is not None else opt


def vissl_optimizer(setup, model: nn.Module):
    """The optimizer VISSL builds for a resolved `config.vissl_setup.VisslSetup`: VISSL's param groups, SGD/Adam(W),
    LARC around SGD if use_larc, at the schedule's learning rate at epoch 0."""
    return build_vissl_optimizer(model, setup.optimizer, lr=setup.schedule_value(0.0))


def vissl_initialize_args(model: nn.Module, config):
    """For `zerodp.initialize(model, None, config)`: (VISSL's optimizer, the zero config) when `config` is a VISSL
    file or mapping; otherwise (None, config) unchanged (config/vissl.py's `vissl_setup_of`)."""
    from ..config.vissl import vissl_setup_of

    setup, config = vissl_setup_of(config)
    return (vissl_optimizer(setup, model) if setup is not None else None), config
