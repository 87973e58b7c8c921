"""Filling a DeepSpeed-style config's "auto" values from Hugging Face `TrainingArguments`.

The same rules the HF Trainer applies to a DeepSpeed config, so a config written for DeepSpeed under
the Trainer works unchanged with ZeroTrainer:
    train_micro_batch_size_per_gpu   per_device_train_batch_size
    gradient_accumulation_steps      gradient_accumulation_steps
    train_batch_size                 per_device_train_batch_size x gradient_accumulation_steps x world size
    gradient_clipping                max_grad_norm
    fp16.enabled / bf16.enabled      fp16 / bf16
    optimizer.params                 lr: learning_rate, betas: [adam_beta1, adam_beta2], eps: adam_epsilon,
                                     weight_decay: weight_decay
    scheduler.params                 warmup_min_lr: 0, warmup_max_lr: learning_rate, warmup_num_steps:
                                     warmup_steps / warmup_ratio, total_num_steps: max_steps
Bucket and persistence sizes are left to the engine (config/auto.py: the one rule set, from the hidden size).
A value given explicitly that contradicts the arguments is an error naming both; nothing is overridden.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional, Union

from ...config import ConfigError
from ...config.compat import AUTO_AT_START, AUTO_OFF


def read_zero_config(source: Union[dict, str, Path]) -> dict:
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"zero_config file {path} does not exist; pass a dict or a path to a .json/.yaml file")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(path.read_text()) or {}
    return json.loads(path.read_text())


class _Filler:
    def __init__(self, data: dict) -> None:
        self.data = data
        self.mismatches: list[str] = []

    def fill(self, dotted: str, value: Any, arg_name: str, required: bool = True) -> None:
        """Set `dotted` to `value` when it is "auto" (or absent and `required`); record a contradiction."""
        *parents, leaf = dotted.split(".")
        node = self.data
        for p in parents:
            if p not in node:
                if not required:
                    return
                node[p] = {}
            node = node[p]
        if leaf not in node:
            if required:
                node[leaf] = value
            return
        given = node[leaf]
        if given == "auto":
            node[leaf] = value
        elif value is not None and _differs(given, value):
            self.mismatches.append(f"{dotted}={given!r} but TrainingArguments.{arg_name}={value!r}")


def _differs(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) != bool(b)
    try:
        return abs(float(a) - float(b)) > 1e-12 * max(1.0, abs(float(b)))
    except (TypeError, ValueError):
        return a != b


def fill_auto(data: dict, args, world_size: int, model=None, max_steps: Optional[int] = None) -> dict:
    """Return `data` with every "auto" filled from `args` (and the scheduler's step counts from `max_steps`,
    when known); ConfigError lists every contradiction."""
    data = copy.deepcopy(data)
    f = _Filler(data)
    mb, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    f.fill("train_micro_batch_size_per_gpu", mb, "per_device_train_batch_size")
    f.fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    f.fill("train_batch_size", mb * gas * world_size, "per_device_train_batch_size x gradient_accumulation_steps "
                                                       "x world size")
    f.fill("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm")
    f.fill("fp16.enabled", bool(args.fp16), "fp16", required="fp16" in data or bool(args.fp16))
    f.fill("bf16.enabled", bool(args.bf16), "bf16", required="bf16" in data or bool(args.bf16))
    if isinstance(data.get("optimizer"), dict):
        f.fill("optimizer.params.lr", args.learning_rate, "learning_rate", required=False)
        f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1/adam_beta2", required=False)
        f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon", required=False)
        f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay", required=False)
    if isinstance(data.get("scheduler"), dict):  # what the HF Trainer fills for DeepSpeed's schedules
        f.fill("scheduler.params.warmup_min_lr", 0, "(HF: 0)", required=False)
        f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate", required=False)
        if max_steps is not None:
            f.fill("scheduler.params.warmup_num_steps", args.get_warmup_steps(max_steps), "warmup_steps/warmup_ratio",
                   required=False)
            f.fill("scheduler.params.total_num_steps", max_steps, "max_steps", required=False)
    # bucket and persistence sizes stay "auto": the engine resolves them from the model's hidden size with
    # the one rule set every entry point shares (config/auto.py), so ZeroTrainer and zerodp.initialize agree
    if f.mismatches:
        raise ConfigError("zero_config contradicts the TrainingArguments: " + "; ".join(f.mismatches)
                          + ". Set these keys to \"auto\" or make them agree")
    leftover = _find_auto(data)
    if leftover and max_steps is None and leftover.startswith("scheduler."):
        leftover = None  # filled when training starts and max_steps is known
    if leftover:
        raise ConfigError(f"zero_config: {leftover} is \"auto\", which ZeroTrainer cannot fill; give a value")
    return data


def _find_auto(node, prefix: str = "") -> Optional[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            found = _find_auto(v, f"{prefix}{k}.")
            if found:
                return found
    elif node == "auto" and prefix.rstrip(".") not in AUTO_AT_START | AUTO_OFF:
        return prefix.rstrip(".")  # (the others: resolved when the config loads or the engine starts)
    return None
