"""The base of every config section: unknown keys are errors naming the closest valid key (zerodp's
own or DeepSpeed's), and a NaN or infinite number is refused. Its own module, so that the offload and
monitor packages can build their sections on it without importing the whole schema.
"""

from __future__ import annotations

import difflib
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from ..errors import ConfigError
from .compat import known_deepspeed_names


# Keys DeepSpeed accepts that zerodp deliberately does not (yet) implement. Refusing them by name is
# kinder than "unknown key": the user learns the feature exists but is not available here.
_NOT_SUPPORTED = {
}
# (Keys that change nothing, aliases and other missing features: see `config_compat`.)


@cache
def deepspeed_key_names() -> frozenset[str]:
    """Every config key name DeepSpeed 0.19.8 reads (deepspeed_keys.txt, derived from its source by
    tools/deepspeed_keys.py): a key zerodp does not know but DeepSpeed does is a missing feature, not a typo."""
    text = (Path(__file__).with_name("deepspeed_keys.txt")).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors that suggest the closest valid key."""

    # allow_inf_nan=False: a NaN or infinite number anywhere in a config is a mistake, refused up front
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        valid = set(cls.model_fields)
        for key in data:
            if key in valid:
                continue
            if key in _NOT_SUPPORTED:
                raise ValueError(f"'{key}' is not supported: {_NOT_SUPPORTED[key]}")
            if key in deepspeed_key_names():
                raise ValueError(f"'{key}' is a DeepSpeed setting whose feature zerodp does not implement here; "
                                 f"remove it (docs/config.md lists what zerodp honours)")
            close = difflib.get_close_matches(str(key), sorted(valid | known_deepspeed_names()), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"
            raise ValueError(f"unknown key '{key}'{hint}")
        return data


# VISSL's top-level sections (or its `config:` wrapper): read by the VISSL adapter only, refused here with the fix.
_VISSL_KEYS = ("config", "OPTIMIZER", "MODEL", "USE_SDP")


def refuse_vissl(data: dict) -> None:
    """One error with the fix for a VISSL file given where zerodp's own config is read."""
    found = [k for k in _VISSL_KEYS if k in data]
    if found:
        raise ConfigError(f"VISSL config: keys {found} are VISSL's dialect, which zerodp's config does not read; "
                          f"build the engine with engine, schedule = zerodp.adapters.vissl.vissl_engine.initialize("
                          f"zerodp.config.vissl.load_vissl(path), model, steps_per_epoch=...), or translate the file for "
                          f"load_config with zerodp.config.vissl.translate_vissl(path)")
