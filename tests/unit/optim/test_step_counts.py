"""[Note: one step count per parameter] (optim/step_counts.py) for each optimizer that gets per-parameter counts:
torch's Adam (with amsgrad: a third state tensor), AdamW's fused CPU kernel (its own arithmetic) and zerodp's
FusedAdam (a Python int `step`). One process: a branch first used at step 1 that skips step 3 trains as the same
optimizer trains it in plain PyTorch (multi-rank parity at every stage: tests/dist/test_step_counts.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp
from tests.oracle import train_reference

PATHS = [False, True, True, False, True, True]
OPTIMIZERS = {"adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=2e-2, amsgrad=True, weight_decay=0.1),
              "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.1, fused=True),
              "fused_adam": lambda ps: zerodp.optim.FusedAdam(ps, lr=2e-2, weight_decay=0.1)}


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 7)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        return self.b(h) if use_b else h


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, 5, generator=g), torch.randn(3, 7, generator=g)


def reference(name: str) -> dict:
    """The oracle: the same optimizer in plain PyTorch."""
    def step_loss(model, step: int) -> torch.Tensor:
        x, y = batch(step)
        return F.mse_loss(model(x, PATHS[step]), y)

    model = Branch()
    return train_reference(model, OPTIMIZERS[name](model.parameters()), len(PATHS), step_loss).params


def train(name: str, stage: int) -> dict:
    model = Branch()
    engine = zerodp.initialize(model, OPTIMIZERS[name](model.parameters()), {"zero_optimization": {"stage": stage}})
    for step, use_b in enumerate(PATHS):
        x, y = batch(step)
        engine.backward(F.mse_loss(engine(x, use_b), y))
        engine.step()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.close()
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 3])
def test_a_late_branch_trains_as_in_plain_pytorch(name, stage):
    ref, got = reference(name), train(name, stage)
    for key, value in ref.items():
        # one process, the same gradients: only the kernel's grouping of tensors may differ (fp32 rounding)
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
