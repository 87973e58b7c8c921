"""The parity oracle (tests/oracle.py) is plain PyTorch, and its tolerances catch a wrong update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.oracle import assert_adam_params_close, assert_matches_reference, train_reference


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def test_the_reference_is_the_plain_loop_bitwise():
    def step_loss(model, step):
        x, y = _batch(step)
        return F.mse_loss(model(x), y)

    model = _net()
    ref = train_reference(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4, step_loss, clip=0.5)
    plain = _net()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(4):
        x, y = _batch(step)
        loss = F.mse_loss(plain(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert ref.losses == losses and ref.grad_norms == norms
    for key, value in plain.state_dict().items():
        assert torch.equal(ref.params[key], value), key


def test_accumulation_divides_each_micro_batch_and_records_the_mean():
    def micro_loss(model, step, micro):
        x, y = _batch(10 * step + micro)
        return F.mse_loss(model(x), y)

    model = _net()
    ref = train_reference(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, micro_loss, accumulation=2)
    plain = _net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(2):
        total = 0.0
        for micro in range(2):
            x, y = _batch(10 * step + micro)
            loss = F.mse_loss(plain(x), y)
            (loss / 2).backward()
            total += loss.item() / 2
        opt.step()
        opt.zero_grad()
        assert ref.losses[step] == total
    for key, value in plain.state_dict().items():
        assert torch.equal(ref.params[key], value), key


def test_the_tolerances_catch_a_wrong_update_of_1e_4():
    params = {"w": torch.full((4, 4), 0.5)}
    wrong = {"w": params["w"].clone()}
    wrong["w"][1, 2] += 1e-4
    assert_matches_reference(0, [1.0], params, [1.0], params)
    with pytest.raises(AssertionError, match="w differs"):
        assert_matches_reference(0, [1.0], wrong, [1.0], params)
    with pytest.raises(AssertionError, match="losses differ"):
        assert_matches_reference(0, [1.0 + 1e-4], params, [1.0], params)
    with pytest.raises(AssertionError, match="beyond 1e-3 of lr"):
        assert_adam_params_close(wrong, params, lr=1e-2, steps=3)
