"""Optimizers that stay exact on ZeRO's flat shards, and how zerodp rebuilds the user's optimizer."""

import sys as _sys

from . import optimizer
from .lamb import LAMB
from .larc import LARC
from .fused_adam import FusedAdam
from .fused_lamb import FusedLamb
from .inner import register_whole_tensor
from .lion import Lion
from .optimizer_list import OptimizerList

# The former module path `zerodp.optimizer` stays importable (code written before the layout change).
_sys.modules.setdefault("zerodp.optimizer", optimizer)
setattr(_sys.modules["zerodp"], "optimizer", optimizer)

__all__ = ["LARC", "LAMB", "FusedAdam", "FusedLamb", "Lion", "OptimizerList", "register_whole_tensor"]
