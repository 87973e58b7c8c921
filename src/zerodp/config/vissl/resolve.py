"""Resolving a VISSL mapping (user keys over VISSL's defaults) into a `VisslSetup`.

The stage, as VISSL chooses its data-parallel wrapper:
    MODEL.FSDP_CONFIG in the user's file, an *fsdp* TRAINER.TASK_NAME, AUTO_SETUP_FSDP or OPTIMIZER.name
    sgd_fsdp                                       -> 3 (FSDP)
    MODEL.SHARDED_DDP_SETUP.USE_SDP (or top-level USE_SDP)  -> 2 (ShardedDDP + OSS)
    OPTIMIZER.use_zero, or OPTIMIZER.name zero     -> 1 (OSS)
    otherwise                                      -> 0 (DDP)
Auto LR scaling follows VISSL's rule: scaled_lr = base_value * (BATCHSIZE_PER_REPLICA * NUM_NODES *
NUM_PROC_PER_NODE) / base_lr_batch_size (sqrt of the factor for scaling_type sqrt), applied to each kind
of schedule as VISSL does, including its per-node linear-warmup start value.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Callable

from ...errors import ConfigError
from .lr_curve import _float, build_lr_curve
from .resolved import (_BASE_KEYS, _READ_MODEL, _SCHEDULE_KEYS, _SUB_SCHEDULE_KEYS, _TOP_KEYS, VisslSetup, _close,
                          _merge)

_OPTIMIZERS = {"sgd", "sgd_fsdp", "adam", "adamw"}


def _flatten_optimizer(opt: dict, check) -> dict:
    """VISSL's nested ZeRO form (`name: zero`, `base_optimizer: {...}`) back to the flat form."""
    if "base_optimizer" not in opt:
        if opt.get("name") == "zero":
            raise ConfigError("VISSL config: OPTIMIZER.name is 'zero' but OPTIMIZER.base_optimizer is missing; "
                              "add base_optimizer: {name: sgd, ...} or use the flat form with use_zero: true")
        return opt

    base = check("OPTIMIZER.base_optimizer", opt["base_optimizer"], _BASE_KEYS)
    flat = {k: v for k, v in opt.items() if k != "base_optimizer"}
    flat.update(base)
    flat["use_zero"] = True
    flat.setdefault("name", "sgd")
    return flat


def _scaled_schedule(lr: dict, cfg: dict, notes: list[str]) -> dict:
    scaling = lr["auto_lr_scaling"]
    if not scaling.get("auto_scale", False):
        return lr
    per_replica = int(cfg["DATA"]["TRAIN"]["BATCHSIZE_PER_REPLICA"])
    nodes, per_node = int(cfg["DISTRIBUTED"]["NUM_NODES"]), int(cfg["DISTRIBUTED"]["NUM_PROC_PER_NODE"])
    base, base_bs = _float("auto_lr_scaling.base_value", scaling["base_value"]), int(scaling["base_lr_batch_size"])
    factor = per_replica * nodes * per_node / base_bs
    if scaling.get("scaling_type", "linear") == "sqrt":
        factor = math.sqrt(factor)
    elif scaling.get("scaling_type", "linear") != "linear":
        raise ConfigError(f"VISSL config: auto_lr_scaling.scaling_type is 'linear' or 'sqrt', "
                          f"got {scaling['scaling_type']!r}")
    notes.append(f"auto LR scaling (VISSL's rule): global batch {per_replica} x {nodes} nodes x {per_node} procs = "
                 f"{per_replica * nodes * per_node}, lr {base:g} -> {base * factor:g} for batch {base_bs}; the "
                 f"batch is the file's, not this run's world size")
    warmup_start = base * per_replica * per_node / base_bs  # VISSL's warmup starts at the per-node scaled lr
    return _scale(copy.deepcopy(lr), base * factor, warmup_start, nodes)


def _scale(spec: dict, lr: float, warmup_start: float, nodes: int) -> dict:
    name = spec["name"]
    if name == "cosine":
        ratio = _float("end_value", spec["end_value"]) / _float("start_value", spec["start_value"])
        spec["start_value"], spec["end_value"] = lr, lr * ratio
    elif name in ("multistep", "step"):
        values = [_float("values", v) for v in spec["values"]]
        gamma = round(values[1] / values[0], 6) if len(values) > 1 else 1.0
        spec["values"] = [round(lr * gamma ** i, 8) for i in range(len(values))]
    elif name == "linear":
        spec["end_value"] = lr
    elif name == "constant":
        spec["value"] = lr
    elif name == "composite":
        subs = [_scale(dict(s), lr, warmup_start, nodes) for s in spec["schedulers"]]
        kept, lengths, scaling = [], list(spec["lengths"]), list(spec["interval_scaling"])
        for i, sub in enumerate(subs):
            if sub["name"] == "linear":
                sub["start_value"] = warmup_start
                if nodes == 1 and warmup_start <= _float("end_value", sub["end_value"]):
                    continue  # on one node VISSL drops a warmup that would not warm up
            kept.append(i)
        if len(kept) == 1:  # one scheduler left: it becomes the schedule (VISSL copies its keys over)
            spec.update(subs[kept[0]])
        else:
            spec["schedulers"] = [subs[i] for i in kept]
            spec["lengths"] = [lengths[i] for i in kept]
            spec["interval_scaling"] = [scaling[i] for i in kept]
    return spec


def _check_schedule(section: str, spec: dict, check, allowed) -> None:
    check(section, spec, allowed)
    if "auto_lr_scaling" in spec:
        check(f"{section}.auto_lr_scaling", spec["auto_lr_scaling"],
              {"auto_scale", "base_value", "base_lr_batch_size", "scaling_type"})

    for i, sub in enumerate(spec.get("schedulers") or []):
        _check_schedule(f"{section}.schedulers[{i}]", sub, check, _SUB_SCHEDULE_KEYS)


def resolve(user: dict, defaults: dict, check: Callable) -> VisslSetup:

    read, notes = ["OPTIMIZER"], []
    ignored = sorted(k for k in user if k not in ("OPTIMIZER", "MODEL", "USE_SDP", "DATA"))
    if "DATA" in user:
        ignored.append("DATA (but TRAIN.BATCHSIZE_PER_REPLICA)")
    for key in user:
        if not str(key).isupper():  # VISSL's sections and top-level options are all upper case
            raise _close("config", key, sorted(_TOP_KEYS))
    user_model = check("MODEL", user.get("MODEL", {}), set(user.get("MODEL", {})))
    ignored += [f"MODEL.{k}" for k in sorted(user_model) if k not in _READ_MODEL]
    for section in _READ_MODEL:
        if section in user_model:
            check(f"MODEL.{section}", user_model[section], defaults["MODEL"][section])
    user_opt = _flatten_optimizer(check("OPTIMIZER", user.get("OPTIMIZER", {}),
                                        set(defaults["OPTIMIZER"]) | {"base_optimizer"}), check)
    check("OPTIMIZER.larc_config", user_opt.get("larc_config", {}), defaults["OPTIMIZER"]["larc_config"])
    if user_opt.get("param_group_constructor", "default") != "default":
        raise ConfigError(f"VISSL config: OPTIMIZER.param_group_constructor '{user_opt['param_group_constructor']}' "
                          f"is not supported; zerodp builds VISSL's 'default' groups (remove the key)")
    if "weight_decay" in (user_opt.get("param_schedulers") or {}):
        raise ConfigError("VISSL config: a weight_decay schedule is not supported by zerodp; remove "
                          "OPTIMIZER.param_schedulers.weight_decay")
    schedulers = check("OPTIMIZER.param_schedulers", user_opt.get("param_schedulers", {}), {"lr", "lr_head"})
    for name, spec in schedulers.items():
        _check_schedule(f"OPTIMIZER.param_schedulers.{name}", spec, check, _SCHEDULE_KEYS)
    cfg = _merge(defaults, {k: v for k, v in user.items() if k in ("MODEL", "DATA", "DISTRIBUTED", "TRAINER")})
    opt = _merge(defaults["OPTIMIZER"], user_opt)
    model = cfg["MODEL"]

    # -- the stage -----------------------------------------------------------------------------
    fsdp_cfg, sdp_cfg, amp = model["FSDP_CONFIG"], model["SHARDED_DDP_SETUP"], model["AMP_PARAMS"]
    if fsdp_cfg["AUTO_SETUP_FSDP"]:  # VISSL's own inference of the FSDP settings from AMP
        fsdp_cfg["compute_dtype"] = "float16" if amp["USE_AMP"] and fsdp_cfg["AMP_TYPE"] == "O2" else "float32"
        fsdp_cfg["mixed_precision"] = bool(amp["USE_AMP"])
        fsdp_cfg["fp32_reduce_scatter"] = bool(amp["USE_AMP"]) and fsdp_cfg["AMP_TYPE"] == "O1"
    use_sdp = bool(sdp_cfg["USE_SDP"]) or bool(user.get("USE_SDP", False))
    use_fsdp = ("FSDP_CONFIG" in user_model or "fsdp" in str(cfg["TRAINER"]["TASK_NAME"])
                or bool(fsdp_cfg["AUTO_SETUP_FSDP"]) or opt["name"] == "sgd_fsdp")
    if use_sdp and use_fsdp:
        raise ConfigError("VISSL config: both ShardedDDP (USE_SDP) and FSDP are configured; keep one "
                          "(USE_SDP: stage 2, FSDP_CONFIG: stage 3)")
    stage = 3 if use_fsdp else 2 if use_sdp else 1 if (opt["use_zero"] or opt["name"] == "zero") else 0
    zero: dict = {"stage": stage}
    out: dict = {"zero_optimization": zero,
                 "train_micro_batch_size_per_gpu": int(cfg["DATA"]["TRAIN"]["BATCHSIZE_PER_REPLICA"])}
    if "DATA" in user:
        read.append("DATA.TRAIN.BATCHSIZE_PER_REPLICA")
    read += [f"MODEL.{k}" for k in sorted(_READ_MODEL & set(user_model))]
    if stage == 2:
        # fairscale's ShardedDDP counts its reduce buffer in elements, as zerodp does; -1 is its default
        # (2**23) and 0 means no bucketing (one bucket per parameter)
        buffer = int(sdp_cfg["reduce_buffer_size"])
        zero["reduce_bucket_size"] = 2 ** 23 if buffer < 0 else max(buffer, 1)
    elif "reduce_buffer_size" in user_model.get("SHARDED_DDP_SETUP", {}):
        warnings.warn("VISSL config: MODEL.SHARDED_DDP_SETUP.reduce_buffer_size has no effect without USE_SDP "
                      "(VISSL passes it to ShardedDDP only)", UserWarning, stacklevel=3)
    if stage == 3:
        _fsdp(fsdp_cfg, zero, notes)

    # -- precision -----------------------------------------------------------------------------
    half_compute = stage == 3 and fsdp_cfg["mixed_precision"] and fsdp_cfg["compute_dtype"] == "float16"
    if amp["USE_AMP"] or half_compute:
        loss_scale = (amp.get("AMP_ARGS") or {}).get("loss_scale", "dynamic")
        out["fp16"] = {"enabled": True, "loss_scale": 0.0 if loss_scale == "dynamic" else float(loss_scale)}
        if amp["USE_AMP"] and not half_compute:
            level = (amp.get("AMP_ARGS") or {}).get("opt_level", "O1") if amp["AMP_TYPE"] == "apex" else "autocast"
            notes.append(f"MODEL.AMP_PARAMS (AMP_TYPE {amp['AMP_TYPE']}, {level}): zerodp computes in fp16 with fp32 "
                         f"master weights and dynamic loss scaling (the whole model in fp16, not per-op autocast)")
    if model["GRAD_CLIP"]["USE_GRAD_CLIP"]:
        if float(model["GRAD_CLIP"]["NORM_TYPE"]) != 2.0:
            raise ConfigError(f"VISSL config: MODEL.GRAD_CLIP.NORM_TYPE={model['GRAD_CLIP']['NORM_TYPE']} is not "
                              f"supported; zerodp clips the global L2 norm (NORM_TYPE: 2)")
        out["gradient_clipping"] = _float("MODEL.GRAD_CLIP.MAX_NORM", model["GRAD_CLIP"]["MAX_NORM"])

    # -- optimizer -----------------------------------------------------------------------------
    name = "sgd" if opt["name"] in ("sgd_fsdp", "zero") else str(opt["name"]).lower()
    if opt["name"] not in _OPTIMIZERS and opt["name"] != "zero":
        raise ConfigError(f"VISSL config: OPTIMIZER.name '{opt['name']}' is not supported; use one of "
                          f"{', '.join(sorted(_OPTIMIZERS))}")
    head = opt["head_optimizer_params"]
    if head["use_different_lr"] or head["use_different_wd"]:
        raise ConfigError("VISSL config: a different lr or weight decay for the head is not supported; set "
                          "OPTIMIZER.head_optimizer_params.use_different_lr/use_different_wd to false")
    if opt["use_larc"] and name != "sgd":
        raise ConfigError(f"VISSL config: use_larc is supported with SGD only (as in VISSL), not '{opt['name']}'")
    larc = None
    if opt["use_larc"]:
        lc = opt["larc_config"]
        larc = {"clip": bool(lc["clip"]), "trust_coefficient": _float("larc_config.trust_coefficient",
                                                                      lc["trust_coefficient"]),
                "eps": _float("larc_config.eps", lc["eps"])}
    spec = {"name": name, "weight_decay": _float("OPTIMIZER.weight_decay", opt["weight_decay"]),
            "momentum": _float("OPTIMIZER.momentum", opt["momentum"]), "nesterov": bool(opt["nesterov"]),
            "betas": [_float("OPTIMIZER.betas", b) for b in opt["betas"]], "larc": larc,
            "regularize_bn": bool(opt["regularize_bn"]), "regularize_bias": bool(opt["regularize_bias"]),
            "non_regularized_parameters": list(opt["non_regularized_parameters"]),
            "single_group": bool(opt["construct_single_param_group_only"])}
    if "lr" in user_opt:  # only the nested base_optimizer form (older zerodp files) carries a fixed lr
        lr_spec = {"name": "constant", "value": _float("OPTIMIZER.base_optimizer.lr", user_opt["lr"]),
                   "update_interval": "step"}
    else:
        lr_spec = _scaled_schedule(opt["param_schedulers"]["lr"], cfg, notes)
    build_lr_curve(lr_spec, int(opt["num_epochs"]))  # a bad schedule fails here, at load, not mid-training
    return VisslSetup(zero_config=out, optimizer=spec, lr_schedule_spec=lr_spec, num_epochs=int(opt["num_epochs"]),
                      update_interval=str(lr_spec.get("update_interval", "epoch")), read=read, ignored=ignored,
                      notes=notes)


def _fsdp(fsdp: dict, zero: dict, notes: list[str]) -> None:
    """MODEL.FSDP_CONFIG at stage 3: each key honoured, or reported with what zerodp does instead."""
    zero["stage3_param_persistence_threshold"] = 0  # FSDP shards every parameter of a wrapped module
    if int(fsdp["AUTO_WRAP_THRESHOLD"]) > 0:
        zero["stage3_unit_min_params"] = int(fsdp["AUTO_WRAP_THRESHOLD"])  # same meaning: big modules get a unit
    if fsdp["FORCE_SYNC_CUDA"]:
        zero["overlap_comm"] = False  # wait for each unit's communication, as FORCE_SYNC_CUDA does
    if not fsdp["flatten_parameters"]:
        notes.append("MODEL.FSDP_CONFIG.flatten_parameters=False: zerodp always flattens each unit; LARC still "
                     "uses whole-parameter norms, so the update is unchanged")
    if fsdp["mixed_precision"] and fsdp["fp32_reduce_scatter"]:
        notes.append("MODEL.FSDP_CONFIG.fp32_reduce_scatter=True is not honoured: zerodp reduce-scatters gradients "
                     "in the compute dtype")
    if int(fsdp["bucket_cap_mb"]) > 0:
        notes.append(f"MODEL.FSDP_CONFIG.bucket_cap_mb={fsdp['bucket_cap_mb']} is not used: zerodp reduces "
                     f"gradients per unit")
    if fsdp["mixed_precision"] and fsdp["clear_autocast_cache"]:
        notes.append("MODEL.FSDP_CONFIG.clear_autocast_cache: zerodp does not use autocast, nothing to clear")
