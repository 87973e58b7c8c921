"""Configuration: pydantic models that accept DeepSpeed's keys (`schema.py`) and VISSL's dialect (`vissl.py`).

`zerodp.config` re-exports everything of `schema.py`, so `from zerodp.config import ZeroConfig, load_config`
works as it always has.
"""

import sys as _sys

from . import vissl
from .schema import *  # noqa: F401,F403 (the public config API)
from .schema import reference_markdown  # noqa: F401 (named for readers and linters)

# The former module path `zerodp.config_vissl` stays importable (code written before the layout change).
_sys.modules.setdefault("zerodp.config_vissl", vissl)
setattr(_sys.modules["zerodp"], "config_vissl", vissl)
