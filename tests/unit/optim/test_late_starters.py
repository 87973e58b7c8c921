"""[Note: one step count per chunk] (optim/late_starters.py): under an optimizer with a step count that zerodp does not
keep per parameter (LAMB, NAdam), a parameter that missed a step and later gets a gradient is stepped with its flat
chunk's count, not its own; zerodp says so once, naming the parameter, instead of differing from torch.optim in
silence. Adam, AdamW and FusedAdam keep each parameter's own count (optim/step_counts.py; their parity with torch is
tests/dist/test_step_counts.py) and are not warned about, nor are optimizers without a step count (SGD) and models
whose every parameter gets a gradient at every step."""

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
    opt = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2), "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
           "fused_adam": lambda ps: zerodp.optim.FusedAdam(ps, lr=1e-2),
           "lamb": lambda ps: zerodp.optim.LAMB(ps, lr=1e-2), "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
           "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)}[optimizer](model.parameters())
    engine = zerodp.initialize(model, opt, {"zero_optimization": {"stage": stage}})
    x, y = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for use_b in paths:
            engine.backward(F.mse_loss(engine(x, use_b), y))
            engine.step()
    engine.close()
    return [str(w.message) for w in caught if "missing an earlier step" in str(w.message)]


@pytest.mark.parametrize("stage,optimizer,name", [(1, "lamb", "LAMB"), (3, "lamb", "LAMB"), (1, "nadam", "NAdam")])
def test_a_parameter_that_missed_a_step_is_named_once(stage, optimizer, name):
    said = late_starter_warnings(stage, optimizer, [False, True, True, False, True])
    assert len(said) == 1, said
    assert "b.weight" in said[0] and "b.bias" in said[0] and "a.weight" not in said[0], said
    assert f"{name} keeps one step count per flat chunk" in said[0]


@pytest.mark.parametrize("optimizer,paths", [("sgd", [False, True, True]), ("adamw", [True, True, True]),
                                             ("adamw", [True, False, False]),
                                             ("adamw", [False, True, True, False, True]),
                                             ("adam", [False, True, True, False, True]),
                                             ("fused_adam", [False, True, True, False, True])])
def test_no_warning_without_a_step_count_or_a_late_gradient(optimizer, paths):
    assert late_starter_warnings(1, optimizer, paths) == []
