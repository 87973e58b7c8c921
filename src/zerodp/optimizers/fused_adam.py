"""Adam as DeepSpeed's FusedAdam computes it, in plain torch (elementwise, so exact on flat shards).

    m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
    with bias_correction:    m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^t)   (else m_hat = m, v_hat = v)
    adam_w_mode (AdamW):     p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
    L2 mode (adam_w_mode false): g <- g + wd * p before the moments, then p <- p - lr * m_hat / (sqrt(v_hat) + eps)
zerodp builds torch.optim.Adam/AdamW for DeepSpeed's Adam types (the same update); this class is only
needed for what torch lacks: `bias_correction: false`.
"""

from __future__ import annotations

import torch


class FusedAdam(torch.optim.Optimizer):
    """DeepSpeed's FusedAdam update (adam_w_mode, bias_correction), computed per element in torch."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0) -> None:
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"invalid Adam hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      adam_w_mode=adam_w_mode, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                g = p.grad if group["adam_w_mode"] or not wd else p.grad.add(p, alpha=wd)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
                update = (m / bc1) / ((v / bc2).sqrt_().add_(eps))
                if group["adam_w_mode"] and wd:
                    update.add_(p, alpha=wd)
                p.sub_(update, alpha=lr)
        return loss
