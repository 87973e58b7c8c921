"""Configuration: pydantic models that accept DeepSpeed's keys (`schema.py`). VISSL's dialect is translated by
its adapter (`zerodp.vissl`, `zerodp.integrations.vissl`) before a config is loaded.

`zerodp.config` re-exports everything of `schema.py`, so `from zerodp.config import ZeroConfig, load_config`
works as it always has.
"""

from .schema import *  # noqa: F401,F403 (the public config API)
from .schema import reference_markdown  # noqa: F401 (named for readers and linters)
