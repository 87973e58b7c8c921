"""[Note: one step count per chunk] (optim/late_starters.py): a parameter that missed a step and later gets a gradient
is stepped with its flat chunk's step count, not its own as torch's Adam-family optimizers keep it; zerodp says so once,
naming the parameter, instead of differing from torch.optim in silence. Optimizers without a step count (SGD) and
models whose every parameter gets a gradient at every step are not warned about."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        h = self.a(x)
        return self.b(h) if use_b else h


def late_starter_warnings(stage: int, optimizer: str, paths: list[bool]) -> list[str]:
    model = Branches()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw" else torch.optim.SGD(
        model.parameters(), lr=1e-2, momentum=0.9)
    engine = zerodp.initialize(model, opt, {"zero_optimization": {"stage": stage}})
    x, y = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for use_b in paths:
            engine.backward(F.mse_loss(engine(x, use_b), y))
            engine.step()
    engine.close()
    return [str(w.message) for w in caught if "missing an earlier step" in str(w.message)]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_that_missed_a_step_is_named_once(stage):
    said = late_starter_warnings(stage, "adamw", [False, True, True, False, True])
    assert len(said) == 1, said
    assert "b.weight" in said[0] and "b.bias" in said[0] and "a.weight" not in said[0], said
    assert "AdamW keeps one step count per flat chunk" in said[0]


@pytest.mark.parametrize("optimizer,paths", [("sgd", [False, True, True]), ("adamw", [True, True, True]),
                                             ("adamw", [True, False, False])])
def test_no_warning_without_a_step_count_or_a_late_gradient(optimizer, paths):
    assert late_starter_warnings(1, optimizer, paths) == []
