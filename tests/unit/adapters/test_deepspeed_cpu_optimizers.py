"""`deepspeed.ops`' CPU optimizers as Accelerate builds them under offload_optimizer (map_pytorch_optim_to_deepspeed:
`DeepSpeedCPUAdam(user_optimizer.param_groups, lr=..., weight_decay=..., adamw_mode=<is it AdamW>)`, likewise
DeepSpeedCPUAdagrad and DeepSpeedCPULion): the same update as the torch optimizer they replace, step by step and
bitwise (the same torch kernels), and over the same param group dicts, so a scheduler on the user's optimizer still
drives them. Lion against its formula written out here; and Lion on zerodp's flat shards against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodp.deepspeed as deepspeed
from zerodp.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from zerodp.deepspeed.ops.adam import DeepSpeedCPUAdam
from zerodp.deepspeed.ops.lion import DeepSpeedCPULion
from tests.oracle import train_reference


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]


def _run(opt, params, steps=3):
    for k in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.sin(torch.arange(p.numel(), dtype=p.dtype).view_as(p) * (k + 1) + i)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("torch_class, adamw_mode", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_cpu_adam_is_the_torch_optimizer_accelerate_replaces(torch_class, adamw_mode):
    ref_params, params = _params(), _params()
    ref = torch_class(ref_params, lr=0.1, weight_decay=0.05)
    user = torch_class(params, lr=0.1, weight_decay=0.05)
    cpu = DeepSpeedCPUAdam(user.param_groups, lr=0.1, weight_decay=0.05, adamw_mode=adamw_mode)
    assert cpu.param_groups[0] is user.param_groups[0]  # Accelerate passes the groups: the dicts are shared
    for got, want in zip(_run(cpu, params), _run(ref, ref_params)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cpu_adagrad_is_torch_adagrad():
    ref_params, params = _params(), _params()
    ref = torch.optim.Adagrad(ref_params, lr=0.1, weight_decay=0.05)
    cpu = DeepSpeedCPUAdagrad(torch.optim.Adagrad(params, lr=0.1, weight_decay=0.05).param_groups, lr=0.1,
                              weight_decay=0.05)
    for got, want in zip(_run(cpu, params), _run(ref, ref_params)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="AMSGrad"):
        DeepSpeedCPUAdagrad(_params(), amsgrad=True)


def test_cpu_lion_is_lions_formula():
    lr, (b1, b2), wd = 0.01, (0.9, 0.99), 0.1
    params = _params()
    got = _run(DeepSpeedCPULion(params, lr=lr, betas=(b1, b2), weight_decay=wd), params)
    want, moments = _params(), None
    for k in range(3):
        grads = [torch.sin(torch.arange(p.numel(), dtype=p.dtype).view_as(p) * (k + 1) + i) for i, p in enumerate(want)]
        moments = moments or [torch.zeros_like(p) for p in want]
        for p, g, m in zip(want, grads, moments):
            with torch.no_grad():
                p.copy_(p * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * g))
            m.copy_(b2 * m + (1 - b2) * g)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)  # the same terms, in another order of operations


@pytest.mark.parametrize("stage", [2, 3])
def test_lion_on_zerodps_shards_equals_plain_pytorch(stage):
    """A config's `"type": "Lion"` (DeepSpeed's) builds it; elementwise, so the shards step exactly."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    data = [(torch.randn(3, 4, generator=torch.Generator().manual_seed(k)), torch.randn(3, 2)) for k in range(3)]
    ref = model()
    train_reference(ref, DeepSpeedCPULion(ref.parameters(), lr=0.01, weight_decay=0.1), len(data),
                    lambda m, step: F.mse_loss(m(data[step][0]), data[step][1]))
    engine, *_ = deepspeed.initialize(model=model(), config={
        "train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Lion", "params": {"lr": 0.01, "weight_decay": 0.1}}}, model_parameters=None)
    for x, y in data:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-6, atol=1e-7)
    engine.destroy()
