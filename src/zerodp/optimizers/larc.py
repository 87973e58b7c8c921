"""LARC: layer-wise adaptive rate control around any optimizer (apex's interface and semantics).

For each parameter p with gradient g and weight decay wd of its group:
    local_lr = trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps)
    clip=True:  local_lr = min(local_lr / lr, 1)          (LARC clipping mode)
    g <- (g + wd * p) * local_lr, and the inner optimizer steps with weight_decay = 0.
Parameters whose weight or gradient norm is zero are left unscaled and without weight decay.
Norms are whole-parameter norms even when zerodp hands the optimizer flat shards (`ShardNorms`).
"""

from __future__ import annotations

import torch

from .shard_norms import ShardNorms


class LARC:
    """Wrap `optimizer` with LARC (VISSL's `use_larc`); behaves like the wrapped optimizer otherwise."""

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8) -> None:
        if trust_coefficient <= 0:
            raise ValueError(f"LARC trust_coefficient must be > 0, got {trust_coefficient}")
        self.optim = optimizer
        self.trust_coefficient, self.clip, self.eps = trust_coefficient, clip, eps
        self.shard_norms = ShardNorms()

    @property
    def settings(self) -> dict:
        return {"trust_coefficient": self.trust_coefficient, "clip": self.clip, "eps": self.eps}

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optim.load_state_dict(state)

    def __repr__(self) -> str:
        return f"LARC({self.optim!r}, {self.settings})"

    @torch.no_grad()
    def step(self, closure=None):
        saved_wd = []
        for group in self.optim.param_groups:
            wd = group.get("weight_decay", 0.0)
            saved_wd.append(wd)
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            p_norms = self.shard_norms.norms(params, params)
            g_norms = self.shard_norms.norms(grads, params)
            for p, g, pn, gn in zip(params, grads, p_norms, g_norms):
                active = (pn != 0) & (gn != 0)
                local_lr = self.trust_coefficient * pn / (gn + pn * wd + self.eps)
                if self.clip:
                    local_lr = torch.clamp(local_lr / group["lr"], max=1.0)
                if wd != 0:
                    g.add_(torch.where(active, p * wd, torch.zeros_like(p)))
                g.mul_(torch.where(active, local_lr, torch.ones_like(local_lr)))
            group["weight_decay"] = 0.0
        try:
            return self.optim.step(closure)
        finally:
            for group, wd in zip(self.optim.param_groups, saved_wd):
                group["weight_decay"] = wd
