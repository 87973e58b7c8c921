"""A classic Mixture-of-Experts for the multi-rank tests: experts in an `nn.ModuleList`, a top-2 router,
and an expert that is not called when no token reaches it, so ranks with different tokens run different
modules. Width 256: each expert Linear (256 x 512 = 131,072 elements) is above the default
`stage3_unit_min_params` (100,000), which used to make every expert Linear a stage-3 unit of its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IN, WIDTH, OUT, EXPERTS = 16, 256, 8, 8


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, 2 * width, bias=False)
        self.w2 = nn.Linear(2 * width, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(h)))


class MoE(nn.Module):
    """Top-2 routing; an expert no token is routed to is not called (its parameters get no gradient)."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))
        self.used: list[int] = []  # the experts called in the last forward (tests read it)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # softmax over the top-2 logits: Mixtral's renormalized top-2 softmax, written so that an expert no token
        # chose gets an exactly zero router gradient (through the full softmax it is ~1e-10 of float noise,
        # which Adam turns into lr-sized updates whose sign depends on summation order: STYLE.md, Tests)
        top, chosen = torch.topk(self.router(h), 2, dim=-1)
        weights = F.softmax(top, dim=-1)
        out = torch.zeros_like(h)
        self.used = sorted(set(chosen.flatten().tolist()))
        for e in self.used:
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out = out.index_add(0, rows, weights[rows, slot, None] * self.experts[e](h[rows]))
        return out


class Block(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.moe = MoE(width, experts)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class ClassicMoE(nn.Module):
    def __init__(self, width: int = WIDTH, experts: int = EXPERTS, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, width)
        self.blocks = nn.ModuleList(Block(width, experts) for _ in range(layers))
        self.head = nn.Linear(width, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

    def used_experts(self) -> list[list[int]]:
        return [b.moe.used for b in self.blocks]


def make_moe(seed: int = 3) -> ClassicMoE:
    torch.manual_seed(seed)
    return ClassicMoE()


def moe_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)
