"""Resolving DeepSpeed's "auto" values when the engine starts, as DeepSpeed and the HF integration do.

`config_compat.normalize` records which keys were "auto"; here they get values from what the engine
knows (the world size, the model), or are refused with the value to write:
  - batch sizes: "auto" keys are completed from the others and the world size (train_batch_size =
    micro batch x accumulation steps x world size; accumulation 1 if unknown); refused when neither
    train_batch_size nor the micro batch is given;
  - bucket sizes, from the model's hidden size h as the HF integration sets them:
        reduce_bucket_size = h*h,  stage3_prefetch_bucket_size = 0.9*h*h,
        stage3_param_persistence_threshold = 10*h   (allgather_bucket_size: h*h like reduce);
  - gradient_clipping "auto" is the HF Trainer's max_grad_norm, which zerodp cannot know: refused.
The model's hidden size is `model.config.hidden_size` (or `hidden_sizes`, `d_model`, `n_embd`), as
HF reads it; for a model without a config, the widest nn.Embedding, else the most common Linear width.
"""

from __future__ import annotations

import collections
from typing import Optional

from torch import nn

from ..errors import ConfigError
from .schema import ZeroConfig

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_BUCKET_RULES = {  # key -> elements as a function of the hidden size h (HF's rule)
    "reduce_bucket_size": lambda h: h * h,
    "allgather_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def resolve_auto(config: ZeroConfig, model: nn.Module) -> ZeroConfig:
    """Return `config` with its "auto" keys filled in (a copy), or raise ConfigError naming what to write."""
    autos = set(config._autos)
    if not autos:
        return config
    if {"train_batch_size", "train_micro_batch_size_per_gpu"} <= autos:
        raise ConfigError("train_batch_size and train_micro_batch_size_per_gpu are both 'auto' (the HF Trainer fills "
                          "them in), so the batch size is unknown; write train_micro_batch_size_per_gpu (samples per "
                          "rank per step); train_batch_size then follows from the accumulation steps and world size")
    if "gradient_clipping" in autos:
        raise ConfigError("gradient_clipping is 'auto' (the HF Trainer's max_grad_norm); write a number: 1.0 is the "
                          "HF Trainer's default, 0 disables clipping")
    zero_updates = {}
    bucket_autos = [k for k in _BUCKET_RULES if f"zero_optimization.{k}" in autos]
    if bucket_autos:
        hidden = hidden_size(model)
        if hidden is None:
            raise ConfigError(f"zero_optimization.{bucket_autos[0]} is 'auto', resolved from the model's hidden size, "
                              f"which zerodp cannot find on {type(model).__name__}; write a number of elements "
                              f"(DeepSpeed's default is {_default(bucket_autos[0])})")
        zero_updates = {k: _BUCKET_RULES[k](hidden) for k in bucket_autos}
    resolved = config.model_copy(update={"zero_optimization": config.zero_optimization.model_copy(
        update=zero_updates)})
    resolved._notes = list(config._notes) + [f"zero_optimization.{k}='auto' resolved to {v} from the model's hidden "
                                             f"size" for k, v in zero_updates.items()]
    resolved._autos = set()
    return resolved


def _default(key: str) -> int:
    from .schema import ZeroOptimizationConfig

    return ZeroOptimizationConfig.model_fields[key].default


def hidden_size(model: nn.Module) -> Optional[int]:
    """The model's hidden size as the HF integration reads it, with a fallback for plain torch models."""
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "d_model", "n_embd"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    sizes = getattr(cfg, "hidden_sizes", None)
    if sizes:
        return max(sizes)
    embeddings = [m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        return max(embeddings)
    widths = collections.Counter(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
    return widths.most_common(1)[0][0] if widths else None
