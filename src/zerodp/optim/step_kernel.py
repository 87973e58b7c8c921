"""Which torch implementation steps zerodp's flat fp32 masters: `master_step_settings`.

zerodp rebuilds the user's optimizer over its own master chunks ([Note: optimizer chunks] in
optimizer.py), so it may pick torch's implementation for them, as long as the update is the user's:

- CUDA masters, Adam/AdamW with `fused` left unset: `fused=True`, one kernel per group for every
  chunk (torch's default there is `foreach`, ~10 kernels per group). The fused kernel evaluates the
  same AdamW formula in fp32, with its own order of roundings: results agree to the last bit or two
  (on CPU, max 2.4e-7 on unit-scale parameters after 3 steps), which is why it is only taken on CUDA,
  where zerodp's parity is checked within tolerance (tests/gpu), and never where the user set
  `fused=False`. At 254M on an H100 this is 0.060 s/step instead of 0.085 (issue 32).
- CPU masters: unchanged. torch's default there is its per-tensor loop, and `foreach` gives the same
  bits but is slower on 1 MiB chunks (every op streams all chunks through the cache before the next:
  8M elements, one thread, 0.32 s vs 0.16-0.24 s per step), and `fused` is not bitwise the loop's
  result (the CPU parity tests are bitwise); tests/unit/optim/test_step_kernel.py keeps both facts checked.
"""

from __future__ import annotations

from typing import Any

import torch

# classes whose fused kernel computes the same update as their foreach/loop implementations
FUSED_ON_CUDA = (torch.optim.Adam, torch.optim.AdamW)


def master_step_settings(optimizer_class: type, settings: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The group `settings` zerodp steps masters on `device` with (a new dict; `settings` is not changed)."""
    out = dict(settings)
    if (device.type == "cuda" and optimizer_class in FUSED_ON_CUDA and out.get("fused") is None
            and not out.get("differentiable", False)):
        out["fused"] = True
        out["foreach"] = None  # torch refuses fused together with foreach
    return out


def master_group_settings(user_optimizer, group_settings: list[dict], device: torch.device) -> list[dict]:
    """`master_step_settings` for every user group (each with its own optimizer's class: OptimizerList)."""
    from .inner import members

    return [master_step_settings(type(owner), settings, device)
            for owner, settings in zip(members(user_optimizer), group_settings)]
