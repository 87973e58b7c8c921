"""VISSL's optimizer, rebuilt over a plain PyTorch model from a resolved `zerodp.config.vissl.VisslSetup`: the half
of VISSL's dialect that needs a model or an optimizer (param groups, SGD/Adam(W) with LARC, the lr scheduler
over param groups), so it sits in the adapter, beside its entry (vissl.py), not in the pure translation.

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

from typing import Iterable

import torch
from torch import nn

from ...errors import ConfigError
from ...optimizers.larc import LARC
from ...config.vissl import VisslSetup
from ...config.vissl.lr_curve import WHERE_EPSILON, LRCurve, build_lr_curve

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
    else:  # vissl.resolve validates the name first; this guards direct callers
        raise ConfigError(f"VISSL config: optimizer '{name}' is not supported")
    return LARC(opt, **spec["larc"]) if spec["larc"] is not None else opt


def vissl_optimizer(setup: VisslSetup, model: nn.Module):
    """The optimizer VISSL builds for a resolved `VisslSetup`: VISSL's param groups, SGD/Adam(W),
    LARC around SGD if use_larc, at the schedule's learning rate at epoch 0."""
    return build_vissl_optimizer(model, setup.optimizer, lr=setup.schedule_value(0.0))


def vissl_lr_scheduler(setup: VisslSetup, optimizer, steps_per_epoch: int) -> "VisslLRScheduler":
    """VISSL's learning-rate schedule over `optimizer.param_groups` (engine.optimizer for a zerodp engine)."""
    curve = build_lr_curve(setup.lr_schedule_spec, setup.num_epochs)
    return VisslLRScheduler(optimizer.param_groups, curve, setup.num_epochs, steps_per_epoch, setup.update_interval)


class VisslLRScheduler:
    """Sets `lr` on every param group of an optimizer from a VISSL lr curve, one call per optimizer step.

    Construction sets the learning rate of step 0; call `step()` after each optimizer step (the
    ZeroTrainer/engine user does, like a torch LR scheduler). `lr_at(step)` is the pure formula.
    """

    def __init__(self, param_groups: Iterable[dict], curve: LRCurve, num_epochs: int, steps_per_epoch: int,
                 update_interval: str) -> None:
        if steps_per_epoch < 1:
            raise ConfigError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        if update_interval not in ("step", "epoch"):
            raise ConfigError(f"VISSL config: update_interval is 'step' or 'epoch', got {update_interval!r}")
        self.param_groups = list(param_groups)
        self.curve, self.num_epochs, self.steps_per_epoch = curve, num_epochs, steps_per_epoch
        self.update_interval = update_interval
        self.total_steps = num_epochs * steps_per_epoch
        self.last_step = 0
        self._apply()

    def where(self, step: int) -> float:
        """VISSL's fraction of training done before optimizer step `step` (0-based)."""
        if self.update_interval == "epoch":
            return (step // self.steps_per_epoch) / self.num_epochs
        return step / self.total_steps

    def lr_at(self, step: int) -> float:
        return self.curve(min(self.where(step), 1.0 - WHERE_EPSILON))

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.param_groups]

    def step(self) -> None:
        """Advance one optimizer step and set the learning rate the next step uses."""
        self.last_step += 1
        self._apply()

    def _apply(self) -> None:
        lr = self.lr_at(self.last_step)
        for group in self.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self._apply()
