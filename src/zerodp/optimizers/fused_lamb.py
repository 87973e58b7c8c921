"""LAMB as DeepSpeed's FusedLamb computes it (DeepSpeed's `"type": "Lamb"`), exact under every ZeRO stage.

DeepSpeed's kernel differs from the paper's LAMB (`zerodp.optim.LAMB`) in where bias correction goes:
    m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2           (moments not bias-corrected)
    u = m / (sqrt(v) + eps) + wd p          (eps_inside_sqrt: m / sqrt(v + eps) + wd p)
    c = clamp(||p|| / ||u||, min_coeff, max_coeff)   (1 when either norm is zero)
    step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)     (lr without bias_correction)
    p <- p - step_size * c * u
Norms are whole-parameter norms even on zerodp's flat shards (`ShardNorms`).
"""

from __future__ import annotations

import math

import torch

from .shard_norms import ShardNorms


class FusedLamb(torch.optim.Optimizer):
    """DeepSpeed's FusedLamb update with its defaults (eps 1e-8, max_coeff 10, min_coeff 0.01)."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01) -> None:
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"invalid Lamb hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff))
        self.shard_norms = ShardNorms()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates, step_sizes = [], []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = v.add(group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
                u = m / denom
                if group["weight_decay"]:
                    u.add_(p, alpha=group["weight_decay"])
                updates.append(u)
                bias = math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if group["bias_correction"] else 1.0
                step_sizes.append(group["lr"] * bias)
            w_norms = self.shard_norms.norms(params, params)
            u_norms = self.shard_norms.norms(updates, params)
            for p, u, wn, un, step_size in zip(params, updates, w_norms, u_norms, step_sizes):
                ratio = (wn / un).clamp_(group["min_coeff"], group["max_coeff"])
                coeff = torch.where((wn > 0) & (un > 0), ratio, torch.ones_like(wn))
                p.sub_(u * coeff * step_size)
        return loss
