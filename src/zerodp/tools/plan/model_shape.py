"""The inputs of the peak-RSS model from what a user has: a config and a model (or just its size).

`run_shape_of` reads a validated `ZeroConfig` the way the engine does (stage, precision, the offload
sections with the defaults chosen when keys are unset: offload/tier.py, config/offload.py).
`module_shape` plans stage 3's units from a model built on the meta device (no memory, no values),
with the same `stage3/wrap.py` rules the engine uses, so the gathered units and persistent
parameters of the estimate are the ones a run will have. `uniform_shape` describes a model by its
size alone, as `--params PSI --layers L`: L equal units.
"""

from __future__ import annotations

from typing import Optional

from ...config import ZeroConfig
from ...config.offload import DEFAULT_SUB_GROUP_SIZE
from .formulas import OPTIMIZER_STATES, PRECISIONS
from .peak_rss import ModelShape, RunShape


def run_shape_of(config: ZeroConfig, world_size: int, optimizer: str = "adamw", has_gpu: bool = False) -> RunShape:
    """The `RunShape` of `config` on `world_size` ranks, training with `optimizer` (its state count)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    zero = config.zero_optimization
    mixed = bool(config.bf16.enabled or config.fp16.enabled)
    param_bytes, grad_bytes, master_bytes = PRECISIONS["mixed" if mixed else "fp32"]
    opt, par = zero.offload_optimizer, zero.offload_param
    # Device cpu keeps the bytes in host memory, which is the RSS of a CPU rank; it still maps large
    # buffers on their own (host_memory.py), so it changes the heap retention, not the tiers.
    opt_device, par_device = opt.device.value, par.device.value
    return RunShape(
        world_size=world_size, stage=zero.stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
        master_bytes=master_bytes, state_bytes=4 * OPTIMIZER_STATES[optimizer],
        optimizer_offload=opt_device, offload_ratio=opt.ratio,
        sub_group_size=DEFAULT_SUB_GROUP_SIZE if zero.sub_group_size is None else zero.sub_group_size,
        optimizer_buffer_count=opt.buffer_count, param_offload=par_device, max_in_cpu=par.max_in_cpu,
        param_buffer_count=par.buffer_count, reduce_bucket_size=zero.reduce_bucket_size,
        prefetch_numel=zero.stage3_prefetch_bucket_size, max_live_numel=zero.stage3_max_live_parameters,
        has_gpu=has_gpu)


def module_shape(model, config: ZeroConfig, activation_bytes: float = 0.0,
                 unit_activation_share: Optional[float] = None) -> ModelShape:
    """The `ModelShape` of `model` (an nn.Module, best built under `torch.device("meta")`).

    `unit_activation_share`: the part of `activation_bytes` saved inside the units below the root
    (default: their share of the parameters)."""
    from ...shard.stage3.wrap import choose_unit_modules, plan_units

    zero = config.zero_optimization
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    if not numel:
        raise ValueError("the model has no trainable parameters")
    plans = plan_units(model, choose_unit_modules(model, zero.stage3_unit_modules, zero.stage3_unit_min_params))
    threshold = zero.stage3_param_persistence_threshold
    sharded = [sum(p.numel() for p in plan.params if p.requires_grad and p.numel() >= threshold) for plan in plans]
    persistent = sum(p.numel() for p in params if p.numel() < threshold)
    units = tuple(n for n in sharded[1:] if n)
    share = unit_activation_share if unit_activation_share is not None else sum(units) / numel
    return ModelShape(numel=numel, unit_numels=units, root_numel=sharded[0], persistent_numel=persistent,
                      activation_bytes=activation_bytes, unit_activation_share=share,
                      largest_param_numel=max(p.numel() for p in params))


def uniform_shape(numel: int, layers: int, activation_bytes: float = 0.0) -> ModelShape:
    """A model of `numel` parameters in `layers` equal stage-3 units (nothing persistent, nothing in the
    root); activations, if given, are all saved inside the units."""
    if numel < 1 or layers < 1:
        raise ValueError(f"a model needs at least one parameter and one layer, got {numel} and {layers}")
    per_unit, extra = divmod(numel, layers)
    units = tuple(per_unit + (1 if i < extra else 0) for i in range(layers))
    return ModelShape(numel=numel, unit_numels=units, activation_bytes=activation_bytes,
                      unit_activation_share=1.0, largest_param_numel=max(units))


def gpt_shape(gpt_config, config: ZeroConfig, micro_batch: int, seq_len: int, elem_bytes: int) -> ModelShape:
    """The `ModelShape` of the bundled GPT (`models.gpt`, preset or not) training micro-batches of
    `micro_batch` x `seq_len` tokens with activations of `elem_bytes` per element: the activations by
    `formulas.estimate_activation_bytes`, the blocks' share of them saved inside stage-3 units."""
    import dataclasses

    import torch

    from ..models.gpt import GPT
    from .formulas import estimate_activation_bytes

    act = estimate_activation_bytes(gpt_config, micro_batch, seq_len, elem_bytes)
    blocks = act - estimate_activation_bytes(dataclasses.replace(gpt_config, n_layer=0), micro_batch, seq_len,
                                             elem_bytes)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return module_shape(GPT(gpt_config), config, act, blocks / act)
