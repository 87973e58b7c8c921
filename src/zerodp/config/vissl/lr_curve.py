"""VISSL's learning-rate schedules (`OPTIMIZER.param_schedulers.lr`) as curves: the lr as a function of `where`.

A curve is pure arithmetic (no optimizer, no torch); `integrations.vissl_optimizer.VisslLRScheduler` applies it to
an optimizer's param groups once per optimizer step.

VISSL evaluates a schedule at `where`, the fraction of training done, in [0, 1):
    update_interval: step   where = step / (num_epochs * steps_per_epoch)
    update_interval: epoch  where = epoch / num_epochs   (the value changes only at epoch boundaries)
The schedule kinds, as VISSL (through ClassyVision / fvcore) defines them:
    constant   value
    linear     start_value + where * (end_value - start_value)
    cosine     end_value + (start_value - end_value) * (1 + cos(pi * where)) / 2
    multistep  values[i], i = number of milestones (in epochs) at or below int(where * num_epochs)
    step       values[int(epoch / (num_epochs / len(values)))], epoch = int(where * num_epochs)
    composite  the first sub-schedule whose cumulative `lengths` exceed where; with interval_scaling
               'rescaled' it sees where rescaled to its own interval, with 'fixed' the global where.
A small epsilon (1e-6) is added to where before it is turned into an epoch or a composite interval,
so that float round-off at a boundary picks the later interval, as VISSL does.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable

from ...errors import ConfigError

WHERE_EPSILON = 1e-6
LRCurve = Callable[[float], float]  # where (fraction of training done, in [0, 1)) -> lr

_KEYS = {
    "constant": {"value"},
    "linear": {"start_value", "end_value"},
    "cosine": {"start_value", "end_value"},
    "multistep": {"values", "milestones"},
    "step": {"values"},
    "composite": {"schedulers", "lengths", "interval_scaling"},
}


def _float(section: str, value) -> float:
    try:
        return float(value)  # YAML reads "1e-08" (no dot) as a string; VISSL's files contain such values
    except (TypeError, ValueError):
        raise ConfigError(f"VISSL config: {section} must be a number, got {value!r}") from None


def build_lr_curve(spec: dict, num_epochs: int, section: str = "OPTIMIZER.param_schedulers.lr") -> LRCurve:
    """The curve (a function of `where`) of one VISSL schedule mapping (keys other kinds use are ignored, as in
    VISSL)."""
    name = spec.get("name")
    if name not in _KEYS:
        raise ConfigError(f"VISSL config: {section}.name '{name}' is not supported; zerodp supports "
                          f"{', '.join(sorted(_KEYS))}")
    missing = sorted(k for k in _KEYS[name] if k not in spec and not (name == "multistep" and k == "milestones"))
    if missing:
        raise ConfigError(f"VISSL config: {section} ({name}) needs {', '.join(missing)}")
    if name == "constant":
        value = _float(f"{section}.value", spec["value"])
        return lambda where: value
    if name in ("linear", "cosine"):
        start = _float(f"{section}.start_value", spec["start_value"])
        end = _float(f"{section}.end_value", spec["end_value"])
        if name == "linear":
            return lambda where: start + where * (end - start)
        return lambda where: end + 0.5 * (start - end) * (1.0 + math.cos(math.pi * where))
    values = [_float(f"{section}.values", v) for v in spec["values"]]
    if not values:
        raise ConfigError(f"VISSL config: {section}.values is empty")
    if name == "multistep":
        milestones = spec.get("milestones")
        if not milestones:  # VISSL spaces the steps evenly over the epochs when none are given
            milestones = [num_epochs * i // len(values) for i in range(1, len(values))]
        milestones = [int(m) for m in milestones]
        if len(milestones) != len(values) - 1 or milestones != sorted(milestones) or milestones[-1] >= num_epochs:
            raise ConfigError(f"VISSL config: {section}: {len(values)} values need {len(values) - 1} increasing "
                              f"milestones below num_epochs={num_epochs}, got {milestones}")
        return lambda where: values[bisect.bisect_right(milestones, int((where + WHERE_EPSILON) * num_epochs))]
    if name == "step":
        per_value = num_epochs / len(values)
        return lambda where: values[min(int(int((where + WHERE_EPSILON) * num_epochs) / per_value), len(values) - 1)]
    return _composite(spec, num_epochs, section)


def _composite(spec: dict, num_epochs: int, section: str) -> LRCurve:
    subs, lengths, scaling = spec["schedulers"], spec["lengths"], spec["interval_scaling"]
    if not (len(subs) == len(lengths) == len(scaling)) or not subs:
        raise ConfigError(f"VISSL config: {section} (composite) needs as many lengths and interval_scaling "
                          f"entries as schedulers; got {len(subs)} schedulers, {len(lengths)} lengths, "
                          f"{len(scaling)} interval_scaling")
    lengths = [_float(f"{section}.lengths", x) for x in lengths]
    if abs(sum(lengths) - 1.0) > 1e-3:
        raise ConfigError(f"VISSL config: {section}.lengths must sum to 1, got {sum(lengths):g}")
    for s in scaling:
        if s not in ("rescaled", "fixed"):
            raise ConfigError(f"VISSL config: {section}.interval_scaling entries are 'rescaled' or 'fixed', got {s!r}")
    schedules = [build_lr_curve(sub, num_epochs, f"{section}.schedulers[{i}]") for i, sub in enumerate(subs)]

    def value(where: float) -> float:
        i, end = 0, lengths[0]
        while where + WHERE_EPSILON > end and i < len(schedules) - 1:
            i += 1
            end += lengths[i]
        if scaling[i] == "fixed":
            return schedules[i](where)
        start = end - lengths[i]
        return schedules[i]((where - start) / lengths[i])

    return value
