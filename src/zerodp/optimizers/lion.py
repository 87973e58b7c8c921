"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as DeepSpeed's CPU and fused Lion
compute it, in plain torch (elementwise, so exact on flat shards):

    c = b1 m + (1 - b1) g                  (the interpolation the sign is taken of)
    p <- p (1 - lr wd) - lr sign(c)        (decoupled weight decay)
    m <- b2 m + (1 - b2) g
"""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """The Lion update, per element; state: one momentum (`exp_avg`) per parameter. Defaults: DeepSpeed's."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0) -> None:
        if lr < 0 or not (0 <= betas[0] <= 1 and 0 <= betas[1] <= 1) or weight_decay < 0:
            raise ValueError(f"invalid Lion hyper-parameters lr={lr} betas={betas} wd={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                direction = m.mul(b1).add_(p.grad, alpha=1 - b1).sign_()
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(direction, alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss
