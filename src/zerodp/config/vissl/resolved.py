"""What zerodp reads from a VISSL config: the key sets of the sections it reads, and `VisslSetup`, the
resolved result (`resolve.resolve` builds it; `translate.load_vissl` is the entry point).

A setup is data: what needs a model or an optimizer (VISSL's param groups, its optimizer, the lr scheduler
stepping param groups) is built from it in `integrations/vissl_optimizer.py`; an engine, by
`zerodp.adapters.vissl.vissl_engine.initialize`.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field
from typing import Any, Iterable


from ...errors import ConfigError
from .lr_curve import build_lr_curve

_TOP_KEYS = {"OPTIMIZER", "MODEL", "USE_SDP", "DATA", "LOSS", "TRAINER", "DISTRIBUTED", "MACHINE", "CHECKPOINT",
             "HOOKS", "METERS", "SEED_VALUE"}
_READ_MODEL = {"SHARDED_DDP_SETUP", "FSDP_CONFIG", "AMP_PARAMS", "GRAD_CLIP"}
_BASE_KEYS = {"name", "use_larc", "larc_config", "weight_decay", "momentum", "nesterov", "betas", "lr"}
_SCHEDULE_KEYS = {"auto_lr_scaling", "name", "update_interval", "values", "milestones", "schedulers",
                  "interval_scaling", "lengths", "start_value", "end_value", "value"}
_SUB_SCHEDULE_KEYS = _SCHEDULE_KEYS - {"auto_lr_scaling", "update_interval"}

def _close(section: str, key: str, allowed: Iterable[str]) -> ConfigError:
    close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(allowed))}"
    return ConfigError(f"VISSL config: unknown key '{section}.{key}'{hint}")


def _check_keys(section: str, data: Any, allowed: Iterable[str]) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(f"VISSL config: {section} must be a mapping, got {type(data).__name__}")
    for key in data:
        if key not in allowed:
            raise _close(section, key, allowed)
    return data


def _merge(base: dict, over: dict) -> dict:
    """Hydra-style composition: mappings merge key by key, anything else (lists included) is replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


@dataclass
class VisslSetup:
    """A VISSL config resolved for zerodp: the DeepSpeed-style config plus what needs the model."""

    zero_config: dict
    optimizer: dict            # name, hyper-parameters, LARC, regularization (built by integrations/vissl_optimizer.py)
    lr_schedule_spec: dict     # OPTIMIZER.param_schedulers.lr after VISSL's auto LR scaling
    num_epochs: int
    update_interval: str
    read: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def report(self) -> str:
        """What zerodp read, how each key was honoured, and which sections it left to VISSL's trainer."""
        lines = [f"zerodp read {', '.join(self.read)} from the VISSL config"]
        if self.ignored:
            lines.append(f"ignored (VISSL trainer sections): {', '.join(self.ignored)}")
        return "\n".join(lines + self.notes)

    def schedule_value(self, where: float) -> float:
        """The learning rate at `where`, the fraction of training done (lr_curve.py)."""
        return build_lr_curve(self.lr_schedule_spec, self.num_epochs)(where)
