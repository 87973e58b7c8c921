"""DeepSpeed's learning-rate schedules against their closed forms (DeepSpeed's documented formulas)."""

from __future__ import annotations

import math

import pytest
import torch

from zerodp.optimizers.lr_schedules import LRScheduleError, build_lr_scheduler


def _opt(lr=0.1, cls=torch.optim.AdamW, groups=1):
    params = [[torch.nn.Parameter(torch.zeros(2))] for _ in range(groups)]
    return cls([{"params": p} for p in params], lr=lr)


def _trace(sched, opt, steps):
    """The lr each optimizer step runs at: the one set before it, then the schedule steps."""
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    return lrs


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr(warmup_type):
    opt = _opt()
    sched = build_lr_scheduler("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 5,
                                        "warmup_type": warmup_type}, opt)
    got = _trace(sched, opt, 9)
    gamma = (lambda t: math.log(t + 1) / math.log(5)) if warmup_type == "log" else (lambda t: t / 5)
    want = [0.01] + [0.01 + 0.04 * (gamma(t) if t < 5 else 1.0) for t in range(8)]
    assert got == pytest.approx(want, abs=1e-15)


def test_warmup_decay_lr_reaches_zero():
    opt = _opt()
    sched = build_lr_scheduler("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 1.0, "warmup_num_steps": 4,
                                             "warmup_type": "linear"}, opt)
    got = _trace(sched, opt, 13)
    want = [0.0] + [t / 4 if t < 4 else max(0.0, (10 - t) / 6) for t in range(12)]
    assert got == pytest.approx(want, abs=1e-15)
    assert got[-1] == 0.0


def test_warmup_cosine_lr_scales_the_optimizer_lr():
    opt = _opt(lr=0.2)
    sched = build_lr_scheduler("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_ratio": 0.1,
                                              "cos_min_ratio": 0.01, "warmup_type": "linear"}, opt)
    got = _trace(sched, opt, 14)

    def ratio(t):
        if t < 4:
            return 0.1 + (t / 4) * 0.9
        return max(0.0, 0.01 + 0.99 * (1 + math.cos(math.pi * (t - 3) / 8)) / 2)
    assert got == pytest.approx([0.0] + [0.2 * ratio(t) for t in range(13)], abs=1e-15)


def test_one_cycle_lr_and_momentum():
    opt = _opt()
    sched = build_lr_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
                                        "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5,
                                        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}, opt)
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)
    lrs, moms = [], []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
        sched.step()
    # up over 4 steps (0.1 -> 1.0), down over 2 (back to 0.1), then min_lr / (1 + 0.5 * k / 2), k = 1, 2, ...
    want = [0.1, 0.1 + 0.9 * 1 / 4, 0.1 + 0.9 * 2 / 4, 0.1 + 0.9 * 3 / 4, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1 / 1.25,
            0.1 / 1.5, 0.1 / 1.75]
    assert lrs == pytest.approx(want, abs=1e-12)
    assert moms[4] == pytest.approx(0.85) and moms[1] == pytest.approx(0.95 - 0.1 / 4)
    assert moms[9] == pytest.approx(0.95)  # decay_mom_rate 0: the max momentum after the cycle


def test_lr_range_test_staircase_and_continuous():
    for staircase in (False, True):
        opt = _opt()
        sched = build_lr_scheduler("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3,
                                               "lr_range_test_step_rate": 2.0,
                                               "lr_range_test_staircase": staircase}, opt)
        got = _trace(sched, opt, 7)
        interval = (lambda t: math.floor((t + 1) / 3)) if staircase else (lambda t: (t + 1) / 3)
        assert got == pytest.approx([0.01] + [0.01 * (1 + 2 * interval(t)) for t in range(6)], abs=1e-15)


def test_state_round_trip_resumes_exactly():
    opt_a, opt_b = _opt(), _opt()
    params = {"total_num_steps": 20, "warmup_num_steps": 5}
    a = build_lr_scheduler("WarmupDecayLR", params, opt_a)
    _trace(a, opt_a, 7)
    b = build_lr_scheduler("WarmupDecayLR", params, opt_b)
    b.load_state_dict(a.state_dict())
    opt_b.param_groups[0]["lr"] = opt_a.param_groups[0]["lr"]  # restored with the optimizer, as in DeepSpeed
    assert _trace(a, opt_a, 10) == _trace(b, opt_b, 10)


def test_auto_params_resolve_as_hf_or_are_refused():
    opt = _opt(lr=0.3)
    sched = build_lr_scheduler("WarmupLR", {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 2,
                                        "warmup_type": "linear"}, opt)
    assert _trace(sched, opt, 4) == pytest.approx([0.0, 0.0, 0.15, 0.3])
    with pytest.raises(LRScheduleError, match="warmup_num_steps is 'auto'.*write the number of optimizer steps"):
        build_lr_scheduler("WarmupLR", {"warmup_num_steps": "auto"}, _opt())


@pytest.mark.parametrize("type_, params, fragment", [
    ("Cosine", {}, "unknown; use one of WarmupLR"),
    ("WarmupLR", {"warmup_steps": 3}, "bad params"),
    ("WarmupLR", {"warmup_type": "exp"}, "use 'log' or 'linear'"),
    ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, "2 values but the optimizer has 1 param groups"),
])
def test_bad_sections_name_the_problem(type_, params, fragment):
    with pytest.raises(LRScheduleError, match=fragment):
        build_lr_scheduler(type_, params, _opt())
