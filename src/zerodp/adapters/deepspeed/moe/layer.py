"""`deepspeed.moe.layer.MoE`: refused when constructed (zerodp has no expert parallelism)."""

from __future__ import annotations

import torch


class MoE(torch.nn.Module):
    """DeepSpeed's mixture-of-experts layer; not implemented in zerodp."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("deepspeed.moe.layer.MoE is not supported by zerodp (no expert parallelism); "
                                  "use a dense layer, or write the experts as ordinary modules")
