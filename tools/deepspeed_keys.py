"""Derive every config key name DeepSpeed reads, from its installed source (the bench venv's 0.19.8):

    DS_ACCELERATOR=cpu bench/.venv/bin/python tools/deepspeed_keys.py > src/zerodp/config/deepspeed_keys.txt

Two sources, both read from the installed package: the fields (and their aliases) of every pydantic model
deriving from DeepSpeedConfigModel in `deepspeed.*` modules that import on CPU, and the string constants
that the dict-based sections read (`*_constants.py` / `constants.py` modules, names in UPPER_CASE whose
value is a lower-case identifier). Prints the names, sorted, one per line, after a header.
"""

import importlib
import pkgutil
import re
import sys

import deepspeed
from deepspeed.runtime.config_utils import DeepSpeedConfigModel

names: set[str] = set()
for info in pkgutil.walk_packages(deepspeed.__path__, "deepspeed."):
    if not re.search(r"(config|constants)", info.name) or "ops" in info.name.split("."):
        continue
    try:
        module = importlib.import_module(info.name)
    except Exception:  # modules that need CUDA, triton, ... are skipped
        continue
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, DeepSpeedConfigModel) and obj is not DeepSpeedConfigModel:
            for field_name, field in obj.model_fields.items():
                names.add(field_name)
                if field.alias:
                    names.add(field.alias)
        if info.name.endswith("constants") and isinstance(obj, str) and re.fullmatch(r"[a-z][a-z0-9_]{2,}", obj):
            names.add(obj)
from deepspeed.runtime import config as runtime_config  # noqa: E402  (keys DeepSpeed now refuses as removed)

for table in ("_REMOVED_TOP_LEVEL_CONFIG_KEYS", "_REMOVED_ZERO_CONFIG_KEYS"):
    names.update(getattr(runtime_config, table, {}))
print(f"# config key names DeepSpeed {deepspeed.__version__} reads, derived by tools/deepspeed_keys.py")
print("\n".join(sorted(names)))
