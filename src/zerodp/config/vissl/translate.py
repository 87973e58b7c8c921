"""VISSL config files, read as VISSL writes them, translated into zerodp's config.

    setup = zerodp.config.vissl.load_vissl("swav_8node_resnet.yaml")   # or a list: base, then overlays
    engine, schedule = zerodp.adapters.vissl.vissl_engine.initialize(setup, model, steps_per_epoch=len(loader))
    ... engine.backward(loss); engine.step(); schedule.step()          # per optimizer step

What is read (everything else, e.g. DATA, LOSS, MODEL.TRUNK, MODEL.HEAD, MACHINE, CHECKPOINT, belongs to
VISSL's trainer and is reported once as ignored):
    OPTIMIZER                        optimizer, LARC, param groups, lr schedule (flat or `base_optimizer` form)
    MODEL.SHARDED_DDP_SETUP          USE_SDP -> stage 2; reduce_buffer_size -> reduce_bucket_size
    MODEL.FSDP_CONFIG                present (or an FSDP task / AUTO_SETUP_FSDP) -> stage 3
    MODEL.AMP_PARAMS                 USE_AMP -> fp16 with dynamic loss scaling
    MODEL.GRAD_CLIP                  -> gradient_clipping
    DATA.TRAIN.BATCHSIZE_PER_REPLICA, DISTRIBUTED.NUM_NODES/NUM_PROC_PER_NODE   batch size, auto LR scaling
    TRAINER.TASK_NAME                an *fsdp* task means stage 3
Absent keys take VISSL's own defaults (`defaults.VISSL_DEFAULTS`, from VISSL's defaults.yaml).
Unknown keys inside the sections read are errors naming the closest valid key.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Iterable, Optional, Union


from ...errors import ConfigError
from .defaults import VISSL_DEFAULTS
from .resolve import resolve
from .resolved import VisslSetup, _check_keys, _merge

log = logging.getLogger("zerodp")

Source = Union[str, Path, dict]


def is_vissl(data: dict) -> bool:
    """True when a raw config mapping is written in VISSL's dialect (with or without `config:`)."""
    if isinstance(data.get("config"), dict):
        return True
    return any(k in data for k in ("OPTIMIZER", "MODEL", "USE_SDP"))


def _read_one(source: Source) -> dict:
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"VISSL config file {path} does not exist")
        import yaml

        data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"VISSL config {source}: the top level must be a mapping")
    if "config" in data:  # VISSL's files wrap everything in `config:` (hydra's package `_global_`)
        if set(data) != {"config"}:
            raise ConfigError(f"VISSL config {source}: keys {sorted(set(data) - {'config'})} sit beside 'config:'; "
                              f"move them under it")
        data = data["config"] or {}
    return data


def _apply_override(data: dict, override: str) -> dict:
    """One hydra command-line override, `config.MODEL.AMP_PARAMS.USE_AMP=False`."""
    import yaml

    if "=" not in override:
        raise ConfigError(f"VISSL override {override!r} must look like config.SECTION.KEY=value")
    dotted, value = override.split("=", 1)
    keys = dotted.strip().removeprefix("config.").split(".")
    patch: dict = {keys[-1]: yaml.safe_load(value)}
    for key in reversed(keys[:-1]):
        patch = {key: patch}
    return _merge(data, patch)


def read_vissl(sources: Union[Source, list], overrides: Iterable[str] = ()) -> dict:
    """The user's VISSL mapping: files composed in order (later ones overlay), then the overrides."""
    data: dict = {}
    for source in sources if isinstance(sources, list) else [sources]:
        data = _merge(data, _read_one(source))
    for override in overrides:
        data = _apply_override(data, override)
    return data


def load_vissl(sources: Union[Source, list], overrides: Iterable[str] = (), quiet: bool = False) -> VisslSetup:
    """Resolve VISSL config file(s) (paths or mappings, composed in order) for zerodp; logs the report once."""
    try:
        setup = resolve(read_vissl(sources, overrides), VISSL_DEFAULTS, _check_keys)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as err:  # a value of the wrong type, say
        raise ConfigError(f"VISSL config: {type(err).__name__}: {err}; check the value's type against VISSL's "
                          f"defaults.yaml") from None
    if not quiet:
        log.info("%s", setup.report)
    return setup


def translate_vissl(sources: Union[Source, list], overrides: Iterable[str] = ()) -> dict:
    """VISSL file(s) or mapping as the DeepSpeed-style dict `load_config` reads (it reads no VISSL itself):
    the optimizer section holds one param group at the schedule's first learning rate.
    `zerodp.adapters.vissl.vissl_engine.initialize(load_vissl(...), model, steps_per_epoch)` builds VISSL's param groups
    and schedule instead."""
    setup = load_vissl(sources, overrides, quiet=True)
    out = copy.deepcopy(setup.zero_config)
    opt = setup.optimizer
    params: dict[str, Any] = {"lr": setup.schedule_value(0.0)}
    if opt["name"] == "sgd":
        params.update(momentum=opt["momentum"], nesterov=opt["nesterov"])
    else:
        params["betas"] = opt["betas"]
    params["weight_decay"] = opt["weight_decay"]
    if opt["larc"] is not None:
        params["larc"] = dict(opt["larc"])
    out["optimizer"] = {"type": opt["name"], "params": params}
    return out
