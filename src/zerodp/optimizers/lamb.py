"""LAMB (You et al., 2019): Adam's direction scaled per parameter by a trust ratio.

    m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2,   u = m_hat / (sqrt(v_hat) + eps) + wd p
    r = ||p|| / ||u||   (1 when either norm is zero),   p <- p - lr * r * u
Norms are whole-parameter norms even on zerodp's flat shards (`ShardNorms`).
"""

from __future__ import annotations

import torch

from .shard_norms import ShardNorms


class LAMB(torch.optim.Optimizer):
    """Layer-wise adaptive moments (LAMB), exact under every ZeRO stage."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0) -> None:
        if lr <= 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
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
            updates = []
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
                u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt().add_(group["eps"]))
                if group["weight_decay"]:
                    u.add_(p, alpha=group["weight_decay"])
                updates.append(u)
            w_norms = self.shard_norms.norms(params, params)
            u_norms = self.shard_norms.norms(updates, params)
            for p, u, wn, un in zip(params, updates, w_norms, u_norms):
                ratio = torch.where((wn > 0) & (un > 0), wn / un, torch.ones_like(wn))
                p.sub_(u * ratio * group["lr"])
        return loss
