"""The `torch_autocast` section: what it accepts, refuses and selects (the arithmetic at every stage is
tests/dist/test_torch_autocast.py)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import zerodp
from zerodp.precision.autocast import AutocastPolicy, resolve_module_classes
from zerodp.config import ZeroConfig

BASE = {"train_micro_batch_size_per_gpu": 1}


def cfg(**keys) -> ZeroConfig:
    return ZeroConfig.model_validate({**BASE, **keys})


class MyLinear(nn.Linear):
    pass


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.sub = MyLinear(4, 4)   # a subclass: not safe (DeepSpeed matches the exact class)
        self.norm = nn.LayerNorm(4)
        self.conv = nn.Conv1d(2, 2, 1)

    def forward(self, x):
        return self.norm(self.sub(self.fc(x)))


def test_deepspeed_spellings_and_default_dtype():
    assert cfg(torch_autocast={"enabled": True}).torch_autocast.dtype == "bf16"  # DeepSpeed's documented default
    for spelling in ("bfloat16", "torch.bfloat16", "bf16", "BFloat16"):
        assert cfg(torch_autocast={"enabled": True, "dtype": spelling}).torch_autocast.dtype == "bf16"


@pytest.mark.parametrize("keys,says", [
    ({"torch_autocast": {"enabled": True, "dtype": "float16"}}, "GradScaler"),
    ({"torch_autocast": {"enabled": True, "dtype": "fp32"}}, "computes nothing in lower precision"),
    ({"torch_autocast": {"enabled": True}, "bf16": {"enabled": True}}, "enable one of the two"),
    ({"torch_autocast": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "quantized"),
])
def test_refusals_name_the_fix(keys, says):
    with pytest.raises(ValidationError, match=says):
        cfg(**keys)


def test_disabled_section_is_inert():
    assert AutocastPolicy.from_config(cfg(torch_autocast={"enabled": False, "dtype": "fp16"}), Net()) is None


def test_default_safe_modules_are_exact_classes():
    net = Net()
    policy = AutocastPolicy.from_config(cfg(torch_autocast={"enabled": True}), net)
    safe = {id(p) for m in (net.fc, net.conv) for p in m.parameters()}
    assert policy.low_precision_ids == safe and policy.dtype is torch.bfloat16


def test_named_modules_and_bad_names():
    assert resolve_module_classes(["torch.nn.LayerNorm"]) == (nn.LayerNorm,)
    net = Net()
    policy = AutocastPolicy.from_config(cfg(torch_autocast={"enabled": True,
                                                           "lower_precision_safe_modules": ["torch.nn.LayerNorm"]}), net)
    assert policy.low_precision_ids == {id(p) for p in net.norm.parameters()}
    with pytest.raises(ValueError, match="cannot import 'nosuch.Module'"):
        resolve_module_classes(["nosuch.Module"])
    with pytest.raises(ValueError, match="not an nn.Module class"):
        resolve_module_classes(["torch.tensor"])


def test_forward_overrides_an_enclosing_autocast():
    policy = AutocastPolicy(torch.bfloat16, frozenset())
    lin = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.float16), policy.forward(lin):
        assert lin(torch.randn(2, 4)).dtype is torch.bfloat16


def test_engine_forward_autocasts_and_leaves_a_users_autocast_when_off():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {**BASE, "torch_autocast": {"enabled": True}})
    assert engine(torch.randn(2, 4)).dtype is torch.bfloat16 and model.weight.dtype is torch.float32
    engine.close()
    model = nn.Linear(4, 4)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), BASE)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the section off: the user's autocast stays in force
        assert engine(torch.randn(2, 4)).dtype is torch.bfloat16
    engine.close()
