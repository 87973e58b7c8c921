"""DeepSpeed config compatibility: every DeepSpeed key is honoured, accepted with no effect, or refused.

A raw DeepSpeed mapping passes through `normalize` before pydantic validation:
  1. aliases are renamed to the key zerodp reads (`bfloat16` -> `bf16`, `max_live_parameters` ->
     `stage3_max_live_parameters`, ...);
  2. keys that change nothing in zerodp (`NO_EFFECT`) are removed, and a note saying why is kept for
     the engine to log once at start-up; a value that *would* change something is refused instead,
     naming the missing feature;
  3. keys whose feature zerodp lacks (`REFUSED`) raise a ConfigError naming the feature;
  4. `"auto"` values are resolved where the config alone decides (`enabled: auto` is off, as without
     the HF Trainer), and otherwise recorded for `config.auto.resolve_auto`, which fills them from the
     world size and the model when the engine starts, or refuses naming the value to write.
Everything left is validated by the models in `config.py` (the honoured set); anything else is an
unknown-key error naming the closest valid key. `compat_markdown` renders the three sets for docs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

AUTO = "auto"


@dataclass(frozen=True)
class NoEffect:
    """A DeepSpeed key that changes nothing in zerodp while `accepts(value)`; otherwise refused."""

    reason: str
    accepts: Callable[[Any], bool] = lambda value: True
    refusal: str = ""


def _off(value: Any) -> bool:
    """A section or flag that is switched off: false, null, or a section with enabled false."""
    if isinstance(value, dict):
        return value.get("enabled", False) in (False, AUTO)
    return value in (False, None, AUTO)


def _section_off(feature: str) -> NoEffect:
    return NoEffect(f"switched off; zerodp has no {feature}", _off,
                    f"{feature} is not implemented in zerodp; remove the section or set enabled: false")


# Aliases DeepSpeed accepts, mapped to the key zerodp reads (paths are dotted).
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.gather_16bit_weights_on_model_save": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.model_persistence_threshold": "zero_optimization.stage3_model_persistence_threshold",
    "zero_optimization.module_granularity_threshold": "zero_optimization.stage3_module_granularity_threshold",
    "zero_optimization.use_all_reduce_for_fetch_params": "zero_optimization.stage3_use_all_reduce_for_fetch_params",
}

NO_EFFECT: dict[str, NoEffect] = {
    # -- zero_optimization -------------------------------------------------------------------------
    "zero_optimization.allgather_partitions": NoEffect(
        "zerodp always all-gathers the updated shards after the step (DeepSpeed's default, true)", lambda v: v is True,
        "allgather_partitions=false (a broadcast per partition) is not implemented; remove it or set true"),
    "zero_optimization.stage3_max_reuse_distance": NoEffect(
        "in training zerodp releases a unit's gathered parameters after use and re-gathers them in recorded "
        "order (stage3_prefetch_bucket_size and stage3_max_live_parameters bound what is kept); in evaluation "
        "and generation units stay gathered between forwards within stage3_inference_memory_fraction"),
    "zero_optimization.round_robin_gradients": NoEffect(
        "an ordering of gradient copies for CPU offload in DeepSpeed; results are the same"),
    "zero_optimization.use_multi_rank_bucket_allreduce": NoEffect("a DeepSpeed kernel choice; results are the same"),
    "zero_optimization.memory_efficient_linear": NoEffect(
        "DeepSpeed's stage-3 linear autograd function; zerodp gathers whole units, so nothing differs"),
    "zero_optimization.elastic_checkpoint": NoEffect(
        "zerodp checkpoints always load at any world size or stage"),
    "zero_optimization.load_from_fp32_weights": NoEffect(
        "zerodp always restores the fp32 master weights", lambda v: v is True,
        "loading masters from 16-bit weights is not implemented; remove the key or set true"),
    "zero_optimization.ignore_unused_parameters": NoEffect(
        "zerodp trains models with unused parameters (their gradient is zero)", lambda v: v is True,
        "raising an error on unused parameters is not implemented; remove the key or set true"),
    "zero_optimization.legacy_stage1": NoEffect("a removed DeepSpeed implementation", lambda v: v is False,
                                                "legacy_stage1 is not implemented; remove it"),
    "zero_optimization.zero_quantized_nontrainable_weights": NoEffect(
        "switched off", lambda v: v is False,
        "storing frozen weights quantized (ZeRO++) is not implemented; remove the key (zero_quantized_weights "
        "quantizes every gather)"),
    "zero_optimization.zeropp_loco_param": NoEffect("switched off", lambda v: v is None,
                                                    "ZeRO++ LoCo is not implemented; remove the key"),
    "zero_optimization.stage3_model_persistence_threshold": NoEffect(
        "no limit (DeepSpeed's default)", lambda v: v >= 2 ** 62,
        "a model-wide persistence budget is not implemented; use stage3_param_persistence_threshold"),
    "zero_optimization.stage3_module_granularity_threshold": NoEffect(
        "0 means off", lambda v: v == 0,
        "DeepSpeed's module granularity is not implemented; zerodp's units are set by stage3_unit_modules and "
        "stage3_unit_min_params"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": NoEffect(
        "switched off", lambda v: v is False, "gathering parameters by all-reduce is not implemented; remove it"),
    "zero_optimization.pipeline_loading_checkpoint": NoEffect("switched off", lambda v: v is False,
                                                             "pipelined checkpoint loading is not implemented"),
    "zero_optimization.override_module_apply": NoEffect(
        "DeepSpeed patches Module.apply under zero.Init; zerodp's init_context needs no patch"),
    "zero_optimization.log_trace_cache_warnings": NoEffect("zerodp has no trace cache; unit order is recorded"),
    "zero_optimization.cpu_offload": NoEffect("switched off (deprecated key)", _off,
                                              "write offload_optimizer: {device: cpu} instead (deprecated key)"),
    "zero_optimization.cpu_offload_param": NoEffect("switched off (deprecated key)", _off,
                                                    "write offload_param: {device: cpu} instead (deprecated key)"),
    "zero_optimization.cpu_offload_use_pin_memory": NoEffect("only used with offload (deprecated key)"),
    # -- precision --------------------------------------------------------------------------------
    "fp16.auto_cast": NoEffect("zerodp always casts floating inputs to the compute dtype; inputs already in "
                               "fp16 (what auto_cast false expects) are unchanged by the cast"),
    "fp16.fp16_master_weights_and_grads": NoEffect(
        "switched off", lambda v: v is False, "fp16 master weights are not implemented (masters are fp32)"),
    **{f"bf16.{key}": NoEffect("an fp16 loss-scaling key in the bf16 section: bf16 needs no loss scale "
                               "(DeepSpeed ignores it too)")
       for key in ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale",
                   "consecutive_hysteresis")},
    "bf16.immediate_grad_update": NoEffect("zerodp's bf16 gradients go straight to the reduction buckets"),
    "bf16.check_grad_overflow": NoEffect("switched off", lambda v: v is False,
                                         "overflow checks under bf16 are not implemented; remove the key"),
    "seq_parallel_communication_data_type": NoEffect("zerodp has no sequence parallelism"),
    "amp": _section_off("NVIDIA apex AMP (use bf16 or fp16)"),
    # -- engine, optimizer, data ----------------------------------------------------------------------
    "sparse_gradients": NoEffect("switched off", lambda v: v is False, "sparse gradients are not implemented"),
    "zero_force_ds_cpu_optimizer": NoEffect("zerodp runs torch's optimizers on every device"),
    "optimizer.legacy_fusion": NoEffect("zerodp runs torch's optimizers"),
    "memory_breakdown": NoEffect("switched off (engine.memory_report() measures memory)", lambda v: v is False,
                                 "memory_breakdown logging is not implemented; use engine.memory_report()"),
    "dump_state": NoEffect("switched off", lambda v: v is False, "dump_state is not implemented; remove it"),
    "disable_allgather": NoEffect("switched off", lambda v: v is False, "disable_allgather is not implemented"),
    "graph_harvesting": NoEffect("switched off", lambda v: v is False, "CUDA graph harvesting is not implemented"),
    "cuda_visible_devices": NoEffect("not a DeepSpeed key (DeepSpeed ignores it); set CUDA_VISIBLE_DEVICES"),
    "vocabulary_size": NoEffect("read only by DeepSpeed's sparse-attention and compression utilities"),
    "use_data_before_expert_parallelism": NoEffect("zerodp has no expert parallelism"),
    "checkpoint": NoEffect("zerodp checkpoints are already universal (any world size or stage), validated "
                           "(tags must agree on every rank) and written by every rank in parallel; DeepSpeed's ZeRO "
                           "and universal folders are told apart by their files, without load_universal"),
    "sparse_attention": NoEffect("configures DeepSpeed's sparse-attention modules, which only model code builds"),
    "pipeline": NoEffect("configures deepspeed.pipe.PipelineModule only"),
    "comet": _section_off("Comet monitor"),
    "hybrid_engine": _section_off("hybrid (RLHF inference) engine"),
    "elasticity": _section_off("elastic training"),
    "autotuning": _section_off("autotuner"),
    "compression_training": _section_off("compression training"),
    "quantize_training": _section_off("quantization-aware training"),
    "data_efficiency": _section_off("data efficiency library"),
    "curriculum_learning": _section_off("curriculum learning"),
    "progressive_layer_drop": _section_off("progressive layer drop"),
    "eigenvalue": _section_off("eigenvalue computation"),
    "weight_quantization": _section_off("weight quantization"),
    "nebula": _section_off("Nebula checkpoint service"),
    "compile": NoEffect("switched off; call torch.compile on the model yourself", lambda v: isinstance(v, dict)
                        and not v.get("deepcompile", False) and not v.get("enabled", False),
                        "DeepSpeed's compile integration is not implemented; call torch.compile on the model"),
    "tensor_parallel": NoEffect("tensor-parallel size 1 is none", lambda v: isinstance(v, dict) and
                                v.get("autotp_size", 1) in (0, 1),
                                "automatic tensor parallelism (AutoTP) is not implemented in zerodp; build the model "
                                "from zerodp.tensor_parallel's layers and pass mpu= to initialize"),
}

# Keys whose feature zerodp lacks whatever their value.
REFUSED: dict[str, str] = {}

# "auto" keys resolved when the engine starts (see config/auto.py); any other "auto" is refused here.
AUTO_AT_START = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.allgather_bucket_size",
}
AUTO_OFF = {"fp16.enabled", "bf16.enabled", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
            "csv_monitor.enabled", "tensorboard.enabled", "wandb.enabled", "comms_logger.enabled",
            "flops_profiler.enabled"}


def known_deepspeed_names() -> set[str]:
    """Last components of every DeepSpeed key handled here (offered as "did you mean" suggestions)."""
    return {path.rsplit(".", 1)[-1] for path in (*ALIASES, *NO_EFFECT, *REFUSED)}


class Normalized(dict):
    """The mapping left for validation, with `notes` (no-effect keys) and `autos` (deferred "auto" keys)."""

    notes: list[str]     # keys that change nothing here, with the reason (logged once at start-up)
    warnings: list[str]  # DeepSpeed's leniencies: accepted as DeepSpeed reads them, said as a warning
    autos: set[str]


def normalize(data: dict, error: Callable[[str], Exception]) -> Normalized:
    """Apply aliases, drop no-effect keys (noting why), refuse missing features, record "auto" keys."""
    out = Normalized(_copy(data))
    out.notes, out.warnings, out.autos = [], [], set()
    _apply_aliases(out, error)
    _deprecated_offload_flags(out, error)
    _offload_param_below_stage_3(out)
    for path, rule in NO_EFFECT.items():
        found, value = _get(out, path)
        if not found:
            continue
        if not _accepts(rule, value):
            if not rule.refusal:  # refused by the model that owns the key
                continue
            raise error(f"'{path}': {rule.refusal}")
        _pop(out, path)
        out.notes.append(f"{path}={_show(value)} has no effect in zerodp: {rule.reason}")
    _optimizer_max_grad_norm(out, error)
    _steps_per_print_never(out)
    for path, message in REFUSED.items():
        if _get(out, path)[0]:
            raise error(f"'{path}' is not supported: {message}")
    _collect_autos(out, "", out, error)
    return out


def _deprecated_offload_flags(data: Normalized, error) -> None:
    """DeepSpeed still reads `cpu_offload: true` / `cpu_offload_param: true` as offload to host memory, with a
    deprecation warning; so does zerodp. Together with the section they replaced, it is one error."""
    for flag, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        found, value = _get(data, f"zero_optimization.{flag}")
        if not found or _off(value):
            continue
        has, current = _get(data, f"zero_optimization.{section}")
        if has and str((current or {}).get("device", "none")).lower() not in ("none", "cpu"):
            raise error(f"'zero_optimization.{flag}: true' (deprecated: offload to cpu) contradicts "
                        f"zero_optimization.{section}.device={current.get('device')!r}; keep only {section}")
        _pop(data, f"zero_optimization.{flag}")
        _set(data, f"zero_optimization.{section}", {**(current or {}), "device": "cpu"})
        data.warnings.append(f"zero_optimization.{flag}=true is deprecated (DeepSpeed too): read as "
                          f"zero_optimization.{section}: {{device: cpu}}; write that instead")


def _offload_param_below_stage_3(data: Normalized) -> None:
    """Only stage 3 partitions parameters; DeepSpeed ignores an offload_param section below it (files written
    for several stages carry one), so zerodp drops it and says so."""
    zero = data.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage", 0) in (3, AUTO) or "offload_param" not in zero:
        return
    section = zero.pop("offload_param")
    if isinstance(section, dict) and str(section.get("device", "none")).lower() != "none":
        data.warnings.append(f"zero_optimization.offload_param={_show(section)} has no effect in zerodp at stage "
                          f"{zero.get('stage', 0)}: only stage 3 partitions parameters (DeepSpeed ignores it too)")


def _optimizer_max_grad_norm(data: Normalized, error) -> None:
    """Old DeepSpeed configs clip twice: optimizer.params.max_grad_norm next to gradient_clipping. Equal values
    are one clipping (zerodp's gradient_clipping); anything else is refused, as current DeepSpeed does."""
    found, value = _get(data, "optimizer.params.max_grad_norm")
    if not found:
        return
    clip = data.get("gradient_clipping", 0.0)
    if value != clip and value not in (0, None):
        raise error(f"'optimizer.params.max_grad_norm'={value!r} is not supported (DeepSpeed refuses it too): clip "
                    f"with the top-level 'gradient_clipping' and remove max_grad_norm")
    _pop(data, "optimizer.params.max_grad_norm")
    data.notes.append(f"optimizer.params.max_grad_norm={value!r} has no effect in zerodp: the gradients are "
                      f"clipped once, by gradient_clipping={clip!r}")


def _steps_per_print_never(data: Normalized) -> None:
    """`steps_per_print: inf` (Accelerate writes it into every config) is DeepSpeed's "never": unset, as zerodp's
    own "never" (any other infinite or NaN number stays refused)."""
    value = data.get("steps_per_print")
    if isinstance(value, float) and value == float("inf"):
        del data["steps_per_print"]


def _accepts(rule: NoEffect, value: Any) -> bool:
    try:
        return bool(rule.accepts(value))
    except TypeError:
        return False


def _apply_aliases(data: dict, error) -> None:
    for alias, target in ALIASES.items():
        found, value = _get(data, alias)
        if not found:
            continue
        if _get(data, target)[0]:
            raise error(f"'{alias}' and '{target}' are the same setting (DeepSpeed's alias); keep one")
        _pop(data, alias)
        _set(data, target, value)


def _collect_autos(root: Normalized, prefix: str, node: dict, error) -> None:
    for key in list(node):
        path, value = f"{prefix}{key}", node[key]
        if isinstance(value, dict):
            if path not in ("optimizer.params", "scheduler.params"):  # resolved when built (optim/, lr/)
                _collect_autos(root, path + ".", value, error)
        elif value == AUTO:
            if path in AUTO_OFF:
                node[key] = False
                root.notes.append(f"{path}='auto' means off (as DeepSpeed without the HF Trainer); set true to "
                                  f"enable it")
            elif path in AUTO_AT_START:
                del node[key]
                root.autos.add(path)
            else:
                raise error(f"'{path}' is 'auto', which zerodp cannot resolve for this key; write a value")


def _show(value: Any) -> str:
    return "{...}" if isinstance(value, dict) else repr(value)


def _copy(data: Any) -> Any:
    return {k: _copy(v) for k, v in data.items()} if isinstance(data, dict) else data


def _get(data: dict, path: str) -> tuple[bool, Any]:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _pop(data: dict, path: str) -> None:
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    del node[last]


def _set(data: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def compat_markdown(honoured: list[str], refused: Optional[dict[str, str]] = None) -> str:
    """The three sets as Markdown: honoured keys (from the models), no-effect keys, refused keys."""
    lines = ["## DeepSpeed keys", "",
             "Every DeepSpeed key falls in one of three sets. Keys not listed anywhere are errors that name the "
             "closest valid key.", "",
             "**Honoured with DeepSpeed's meaning** (reference above): " +
             ", ".join(f"`{k}`" for k in honoured) + ".", "",
             "**Aliases** (DeepSpeed's other spellings, read as the key on the right):", "",
             "| alias | read as |", "|---|---|"]
    lines += [f"| `{a}` | `{t}` |" for a, t in ALIASES.items()]
    lines += ["", "**Accepted with no effect** (logged once at start-up with the reason; a value that would "
              "change something is refused, naming the feature):", "", "| key | why it changes nothing |",
              "|---|---|"]
    lines += [f"| `{k}` | {r.reason} |" for k, r in NO_EFFECT.items()]
    lines += ["", "**Refused** (the feature is missing in zerodp):", "", "| key | message |", "|---|---|"]
    lines += [f"| `{k}` | {m} |" for k, m in {**(refused or {}), **REFUSED}.items()]
    lines += ["", "**`\"auto\"`**: " + ", ".join(f"`{k}`" for k in sorted(AUTO_OFF)) + " 'auto' mean off. "
              "Resolved when the engine starts: " + ", ".join(f"`{k}`" for k in sorted(AUTO_AT_START)) + " (see "
              "`zerodp.config.auto`); optimizer and scheduler params when they are built. "
              "Any other 'auto', or one that cannot be resolved, is refused with the value to write."]
    return "\n".join(lines)
