"""[Note: one step count per parameter] (optim/step_counts.py) for each optimizer that gets per-parameter counts:
torch's Adam (with amsgrad: a third state tensor), AdamW's fused CPU kernel (its own arithmetic) and zerodp's
FusedAdam (a Python int `step`). One process: a branch first used at step 1 that skips step 3 trains as the same
optimizer trains it in plain PyTorch (multi-rank parity at every stage: tests/dist/test_step_counts.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp

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


def train(name: str, stage=None) -> dict:
    model = Branch()
    opt = OPTIMIZERS[name](model.parameters())
    engine = zerodp.initialize(model, opt, {"zero_optimization": {"stage": stage}}) if stage is not None else None
    for step, use_b in enumerate(PATHS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(3, 5, generator=g), torch.randn(3, 7, generator=g)
        loss = F.mse_loss((engine or model)(x, use_b), y)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if engine is not None:
        engine.close()
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 3])
def test_a_late_branch_trains_as_in_plain_pytorch(name, stage):
    ref, got = train(name), train(name, stage)
    for key, value in ref.items():
        # one process, the same gradients: only the kernel's grouping of tensors may differ (fp32 rounding)
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
