"""VISSL's YAML dialect of ZeRO, translated to zerodp's (DeepSpeed-style) config.

VISSL configures ZeRO with
    OPTIMIZER: {name: zero, use_zero: true, base_optimizer: {name: sgd, use_larc, larc_config:
                {clip, trust_coefficient, eps}, weight_decay, momentum, nesterov}}
and switches to sharded data parallel (ZeRO stage 2) with `USE_SDP: true` (at the top level or under
MODEL.SHARDED_DDP_SETUP, where VISSL keeps it). `OPTIMIZER.name: zero` alone is stage 1. VISSL takes
its learning rate from a schedule; zerodp accepts a constant `param_schedulers.lr.value` (or
`base_optimizer.lr`). Unknown keys in these sections are errors, like everywhere else, and every
error is a one-line `ConfigError` (a value of the wrong type included).

`MODEL.SHARDED_DDP_SETUP.reduce_buffer_size` is the element count of fairscale's ShardedDDP reduce
buckets, which VISSL passes only when USE_SDP is on (a negative value means fairscale's 2**23). zerodp
honours it as `zero_optimization.reduce_bucket_size` under USE_SDP (0, "no bucketing", becomes one
bucket per parameter) and warns that it has no effect otherwise, as in VISSL. `OPTIMIZER.num_epochs`
is accepted for VISSL files and belongs to the user's training loop, as the learning-rate schedule does.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any

from ..errors import ConfigError

_BASE_KEYS = {"name", "lr", "use_larc", "larc_config", "weight_decay", "momentum", "nesterov"}
_LARC_KEYS = {"clip", "trust_coefficient", "eps"}
_OPTIMIZER_KEYS = {"name", "use_zero", "base_optimizer", "param_schedulers", "num_epochs"}
_SDP_KEYS = {"USE_SDP", "reduce_buffer_size"}
_TOP_KEYS = {"OPTIMIZER", "USE_SDP", "MODEL"}


def is_vissl(data: dict) -> bool:
    """True when a raw config mapping is written in VISSL's dialect."""
    return any(k in data for k in _TOP_KEYS)


def _check_keys(section: str, data: Any, allowed: set[str]) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(f"VISSL config: {section} must be a mapping, not {type(data).__name__}")
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(allowed))}"
            raise ConfigError(f"VISSL config: unknown key '{section}.{key}'{hint}")
    return data


def _learning_rate(opt: dict, base: dict) -> float:
    if "lr" in base:
        return float(base["lr"])
    sched = opt.get("param_schedulers", {}).get("lr", {})
    if sched.get("name", "constant") == "constant" and "value" in sched:
        return float(sched["value"])
    raise ConfigError("VISSL config: zerodp needs a constant learning rate: set "
                      "OPTIMIZER.param_schedulers.lr {name: constant, value: ...} or OPTIMIZER.base_optimizer.lr "
                      "(schedules are applied by your training loop on engine.optimizer.param_groups)")


# fairscale's ShardedDDP default bucket, which VISSL uses for a negative reduce_buffer_size
_SDP_DEFAULT_BUFFER_NUMEL = 2 ** 23


def translate_vissl(data: dict) -> dict:
    """Return the DeepSpeed-style dict equivalent to a VISSL-dialect mapping (ConfigError if it is not valid)."""
    try:
        return _translate(data)
    except (TypeError, ValueError, AttributeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"VISSL config: {err}; check the types of the OPTIMIZER and MODEL values") from None


def _translate(data: dict) -> dict:
    data = dict(data)
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"VISSL config: unknown top-level key(s) {sorted(unknown)}; zerodp reads only "
                          f"{sorted(_TOP_KEYS)} from a VISSL config")
    out: dict[str, Any] = {"zero_optimization": {"stage": 0}}
    use_sdp = bool(data.get("USE_SDP", False))
    model = data.get("MODEL")
    buffer_numel = None
    if model is not None:
        _check_keys("MODEL", model, {"SHARDED_DDP_SETUP"})
        sdp = _check_keys("MODEL.SHARDED_DDP_SETUP", model.get("SHARDED_DDP_SETUP", {}), _SDP_KEYS)
        use_sdp = use_sdp or bool(sdp.get("USE_SDP", False))
        buffer_numel = sdp.get("reduce_buffer_size")
    opt = data.get("OPTIMIZER")
    if opt is not None:
        _check_keys("OPTIMIZER", opt, _OPTIMIZER_KEYS)
        use_zero = opt.get("name") == "zero" or bool(opt.get("use_zero", False))
        base = _check_keys("OPTIMIZER.base_optimizer", opt.get("base_optimizer", {}), _BASE_KEYS)
        name = str(base.get("name", "sgd")).lower()
        params: dict[str, Any] = {"lr": _learning_rate(opt, base)}
        if name == "sgd":
            params.update(momentum=float(base.get("momentum", 0.0)), nesterov=bool(base.get("nesterov", False)))
        params["weight_decay"] = float(base.get("weight_decay", 0.0))
        if base.get("use_larc", False):
            larc = _check_keys("OPTIMIZER.base_optimizer.larc_config", base.get("larc_config", {}), _LARC_KEYS)
            params["larc"] = {k: larc[k] for k in _LARC_KEYS if k in larc}
        out["optimizer"] = {"type": name, "params": params}
        if use_zero:
            out["zero_optimization"]["stage"] = 1
    if use_sdp:
        out["zero_optimization"]["stage"] = 2
        if buffer_numel is not None:
            numel = int(buffer_numel)
            out["zero_optimization"]["reduce_bucket_size"] = _SDP_DEFAULT_BUFFER_NUMEL if numel < 0 else max(1, numel)
    elif buffer_numel is not None and int(buffer_numel) >= 0:
        warnings.warn("VISSL config: MODEL.SHARDED_DDP_SETUP.reduce_buffer_size has no effect without USE_SDP "
                      "(VISSL ignores it too); remove it or set USE_SDP: true", UserWarning, stacklevel=3)
    return out
