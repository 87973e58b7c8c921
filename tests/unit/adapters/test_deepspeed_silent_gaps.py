"""Issue 35's two silent gaps, in process (one rank, no process group), against plain PyTorch in the same test:

1. `engine.backward(loss, scale_wrt_gas=False)` (the HF Trainer divides the loss by the accumulation steps itself):
   zerodp must not divide again;
2. a torch scheduler stepped on the optimizer the user passed (Accelerate steps StepLR / LambdaLR there, not through
   `initialize`): its lr changes must reach the optimizer zerodp steps, whether the scheduler was built before or
   after `initialize`; so must a hand-written `group["lr"] = ...` on the user's optimizer.

Also Accelerate's loop shape: `set_gradient_accumulation_boundary` before each backward, and one `step()` per
accumulation. Tolerance: one process, the same fp32 arithmetic up to summation order in the flat buffers (rtol 1e-6).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp.deepspeed as deepspeed
from tests.oracle import train_reference

GAS, STEPS, LR = 2, 4, 0.05
TOL = {"rtol": 1e-6, "atol": 1e-7}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage}}


def _reference(schedule=None) -> dict:
    """Plain PyTorch: the mean loss of each micro-batch divided by GAS, summed over the accumulation."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = schedule(opt) if schedule else None
    norms, lrs = [], []

    def step_schedule(model, opt, step: int) -> None:
        if sched and step:
            sched.step()  # after each step taken, as the engine steps it

    def record(model, step: int) -> None:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        lrs.append(opt.param_groups[0]["lr"])

    def micro_loss(model, step: int, micro: int) -> torch.Tensor:
        return F.mse_loss(model(_batch(step, micro)[0]), _batch(step, micro)[1])

    train_reference(model, opt, STEPS, micro_loss, accumulation=GAS, before_step=step_schedule, after_backward=record)
    return {"norms": norms, "lrs": lrs, "params": [p.detach().clone() for p in model.parameters()]}


def _params(engine) -> list[torch.Tensor]:
    state = engine.full_state_dict(rank0_only=False)
    return [state[n] for n, _ in engine.module.named_parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_scale_wrt_gas_false_does_not_divide_again(stage):
    ref = _reference()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config(stage))
    norms = []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = _batch(step, micro)
            loss = F.mse_loss(engine(x), y) / GAS  # the HF Trainer divides, then says so
            returned = engine.backward(loss, scale_wrt_gas=False)
            assert returned is loss  # DeepSpeed returns the loss undivided when scale_wrt_gas=False
            engine.step()
        norms.append(engine.get_global_grad_norm())
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref["norms"]), **TOL)
    for got, want in zip(_params(engine), ref["params"]):
        torch.testing.assert_close(got, want, **TOL)
    engine.destroy()


def _steplr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


@pytest.mark.parametrize("built", ["before", "after"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_scheduler_on_the_users_optimizer_reaches_zerodp(stage, built):
    """Accelerate's loop: boundary set before each backward, one step() per accumulation, then StepLR stepped on
    the optimizer the user built (never handed to initialize)."""
    ref = _reference(_steplr)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = _steplr(opt) if built == "before" else None
    engine, returned, _, engine_sched = deepspeed.initialize(model=model, optimizer=opt, config=_config(stage))
    assert engine_sched is None
    sched = sched or _steplr(opt)
    norms, lrs = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for micro in range(GAS):
                engine.set_gradient_accumulation_boundary(micro == GAS - 1)
                x, y = _batch(step, micro)
                engine.backward(F.mse_loss(engine(x), y))
            lrs.append(engine.get_lr()[0])
            engine.step()
            norms.append(engine.get_global_grad_norm())
            sched.step()
    # the user's optimizer counts as stepped (its groups were): torch's scheduler does not warn it never was
    assert not [w for w in caught if "before `optimizer.step()`" in str(w.message)]
    assert engine.global_steps == STEPS
    assert lrs == ref["lrs"] == [LR * 0.5 ** k for k in range(STEPS)]
    assert opt.param_groups[0]["lr"] == returned.param_groups[0]["lr"] == LR * 0.5 ** STEPS
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref["norms"]), **TOL)
    for got, want in zip(_params(engine), ref["params"]):
        torch.testing.assert_close(got, want, **TOL)
    engine.destroy()


def test_a_hand_written_lr_on_the_users_optimizer_reaches_zerodp():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={**_config(2), "gradient_accumulation_steps": 1})
    before = [p.detach().clone() for p in _params(engine)]
    for group in opt.param_groups:
        group["lr"] = 0.0  # a frozen step: nothing may move
    x, y = _batch(0, 0)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    assert engine.get_lr() == [0.0]
    for got, want in zip(_params(engine), before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    engine.destroy()


def test_replacing_the_users_groups_after_initialize_is_refused():
    """torch's load_state_dict / add_param_group on the user's optimizer make new group dicts, whose changes could
    not reach zerodp: the next step refuses, naming what to do."""
    from zerodp.errors import OptimizerError

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={**_config(2), "gradient_accumulation_steps": 1})
    opt.load_state_dict(opt.state_dict())
    x, y = _batch(0, 0)
    engine.backward(F.mse_loss(engine(x), y))
    with pytest.raises(OptimizerError, match="new param groups since .*load_state_dict or add_param_group"):
        engine.step()


def test_a_skipped_step_shows_as_the_optimizers_overflow():
    """Accelerate holds back a scheduler on the user's optimizer when `optimizer.overflow` is true (DeepSpeed's ZeRO
    optimizer sets it when fp16 skips a step); zerodp's skipped step says so too, so the lr schedule does not advance
    past a step that was not taken."""
    model = _model()
    engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 config={**_config(2), "gradient_accumulation_steps": 1,
                                                         "nonfinite": "skip"})
    x, y = _batch(0, 0)
    engine.backward(F.mse_loss(engine(x), y) * float("inf"))  # a non-finite gradient: the step is skipped
    engine.step()
    assert optimizer.overflow is True and engine.skipped_steps == 1
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    assert optimizer.overflow is False
    engine.destroy()
