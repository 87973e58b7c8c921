"""DeepSpeed's learning-rate schedules (the config's `scheduler` section), with DeepSpeed's semantics.

The engine steps the schedule after every optimizer step that was taken (not after an fp16 step
skipped for overflow), as DeepSpeed does; `t` below is `last_batch_iteration`, -1 before the first
step, so the first optimizer step runs at the lr the schedule sets when it is built.
One difference on purpose: before its first step WarmupCosineLR sets every group's lr to 0
(DeepSpeed sets only the first group's).

    WarmupLR        lr = min + (max - min) * gamma(t),  gamma = log(t+1)/log(N) ("log") or t/N
                    ("linear") while t < N, then 1;  N = max(2, warmup_num_steps); t < 0: lr = min
    WarmupDecayLR   as WarmupLR, then gamma = max(0, (T - t) / max(1, T - N))   (T = total_num_steps)
    WarmupCosineLR  lr = base_lr * ratio, base_lr = the optimizer's lr; warm-up ratio
                    r0 + (1 - r0) * gamma(t), then max(0, c + (1 - c) * (1 + cos(pi * s / (T - N))) / 2),
                    s = t - N + 1  (r0 = warmup_min_ratio, c = cos_min_ratio); t < 0: ratio 0
    OneCycle        x = position in the cycle of length L1 + L2 at t+1; lr rises from cycle_min_lr to
                    cycle_max_lr over L1 and falls back over L2 (momentum moves the other way between
                    cycle_max_mom and cycle_min_mom, set as betas[0] with betas[1] = 0.99); after the
                    cycle lr = cycle_min_lr / (1 + decay_lr_rate * (t - L + 1) / decay_step_size)
    LRRangeTest     lr = min_lr * (1 + step_rate * (t+1) / step_size)  (floor of the ratio with staircase)
Every schedule's state is `{"last_batch_iteration": t}`, saved in checkpoints and restored exactly.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence, Union

log = logging.getLogger("zerodp")

Number = Union[float, Sequence[float]]


class LRScheduleError(ValueError):
    """A bad `scheduler` section."""


class StepSchedule:
    """Base: sets each param group's lr (and momentum) for `last_batch_iteration` on every `step()`."""

    def __init__(self, optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: Optional[list[float]] = None

    def lrs(self) -> list[float]:
        raise NotImplementedError

    def momenta(self) -> Optional[list[tuple[float, float]]]:
        return None

    def _apply(self) -> None:
        self._last_lr = self.lrs()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
        betas = self.momenta()
        if betas is not None:
            for group, b in zip(self.optimizer.param_groups, betas):
                group["betas"] = b

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance to the next iteration (or to `last_batch_iteration`) and set the groups' lr."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._apply()

    def get_lr(self) -> list[float]:
        return self.lrs()

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("get_last_lr() before the schedule set a learning rate; call step() first")
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """Restore the iteration (the groups' lr are restored with the optimizer, as in DeepSpeed)."""
        self.last_batch_iteration = state["last_batch_iteration"]

    def _per_group(self, value: Number, name: str) -> list[float]:
        groups = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise LRScheduleError(f"{name} has {len(value)} values but the optimizer has {groups} param groups")
            return [float(v) for v in value]
        return [float(value)] * groups


def _warmup_gamma(t: int, warmup_steps: int, warmup_type: str) -> float:
    """Warm-up progress in [0, 1) for t < warmup_steps ("log" or "linear"), 1 after."""
    if t >= warmup_steps:
        return 1.0
    return math.log(t + 1) / math.log(warmup_steps) if warmup_type == "log" else t / warmup_steps


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in ("log", "linear"):
        raise LRScheduleError(f"warmup_type '{warmup_type}' is unknown; use 'log' or 'linear' (DeepSpeed would fall "
                              f"back to 'log' with a warning)")
    return warmup_type


class WarmupLR(StepSchedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps steps, then hold."""

    def __init__(self, optimizer, warmup_min_lr: Number = 0.0, warmup_max_lr: Number = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._apply()

    def gamma(self) -> float:
        return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def lrs(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self.gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: Number = 0.0, warmup_max_lr: Number = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning("WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d", self.total_num_steps,
                        self.warmup_num_steps)

    def gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return super().gamma()
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(StepSchedule):
    """Warm up the optimizer's lr by a ratio from warmup_min_ratio to 1, then cosine-decay to cos_min_ratio."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply()

    def ratio(self) -> float:
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            g = _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        progress = (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs(self) -> list[float]:
        r = self.ratio()
        return [base * r for base in self.base_lrs]


class OneCycle(StepSchedule):
    """DeepSpeed's 1Cycle: lr up then down over one cycle (momentum inversely), then optional decay."""

    def __init__(self, optimizer, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        # (stair counts are accepted and, as in DeepSpeed, do not change the schedule)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.total_size, self.step_ratio = first + second, first / (first + second)
        self.decay_step_size = decay_step_size
        self.min_lr, self.max_lr, self.decay_lr_rate = float(cycle_min_lr), float(cycle_max_lr), float(decay_lr_rate)
        self.min_mom, self.max_mom, self.decay_mom_rate = float(cycle_min_mom), float(cycle_max_mom), decay_mom_rate
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            log.warning("OneCycle: cycle_momentum is off because %s has no betas", type(optimizer).__name__)
            self.cycle_momentum = False
        if last_batch_iteration == -1:
            for group in optimizer.param_groups:
                group["lr"] = self.min_lr
                if self.cycle_momentum:
                    group["betas"] = (self.min_mom, 0.99)

    def _scale(self) -> float:
        """Position in the cycle: 0 -> 1 over the first part, 1 -> 0 over the second."""
        i = self.last_batch_iteration + 1
        x = 1.0 + i / self.total_size - math.floor(1 + i / self.total_size)
        return x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)

    def _decay_interval(self) -> Optional[float]:
        """Decay intervals after the cycle, or None while in the cycle."""
        if self.last_batch_iteration < self.total_size:
            return None
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size if self.decay_step_size \
            else 0.0

    def lrs(self) -> list[float]:
        interval = self._decay_interval()
        if interval is None:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._scale()
        elif not self.decay_step_size or self.decay_lr_rate == 0:
            lr = self.min_lr
        else:
            lr = self.min_lr / (1 + self.decay_lr_rate * interval)
        return [lr] * len(self.optimizer.param_groups)

    def momenta(self) -> Optional[list[tuple[float, float]]]:
        if not self.cycle_momentum:
            return None
        interval = self._decay_interval()
        if interval is None:
            mom = self.max_mom - (self.max_mom - self.min_mom) * self._scale()
        elif not self.decay_step_size or self.decay_mom_rate == 0:
            mom = self.max_mom
        else:
            mom = self.max_mom * (1 + self.decay_mom_rate * interval)
        return [(mom, 0.99)] * len(self.optimizer.param_groups)


class LRRangeTest(StepSchedule):
    """Raise the lr from lr_range_test_min_lr linearly (or in stairs) every lr_range_test_step_size steps."""

    def __init__(self, optimizer, lr_range_test_min_lr: Number = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            for group, lr in zip(optimizer.param_groups, self.min_lrs):
                group["lr"] = lr
            self._last_lr = list(self.min_lrs)

    def lrs(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def build_lr_scheduler(section_type: str, params: dict[str, Any], optimizer) -> StepSchedule:
    """The schedule named by a `scheduler` section, over `optimizer`'s param groups ("auto" resolved as HF does
    where the optimizer decides it, otherwise refused)."""
    cls = SCHEDULES.get(section_type)
    if cls is None:
        raise LRScheduleError(f"scheduler type '{section_type}' is unknown; use one of {', '.join(SCHEDULES)}")
    params = dict(params)
    for key, value in list(params.items()):
        if value != "auto":
            continue
        if key == "warmup_min_lr":
            params[key] = 0.0  # the HF integration's value
        elif key == "warmup_max_lr":
            params[key] = [group["lr"] for group in optimizer.param_groups]  # HF: the optimizer's learning rate
        else:
            raise LRScheduleError(f"scheduler.params.{key} is 'auto', which the HF Trainer fills in from its "
                                  f"arguments; write the number of optimizer steps")
    try:
        return cls(optimizer, **params)
    except TypeError as err:
        raise LRScheduleError(f"scheduler {section_type}: bad params {sorted(params)}: {err}") from None
