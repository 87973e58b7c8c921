"""Optimizers that stay exact on ZeRO's flat shards, and how zerodp rebuilds the user's optimizer."""

from .lamb import LAMB
from .larc import LARC
from .fused_adam import FusedAdam
from .fused_lamb import FusedLamb

__all__ = ["LARC", "LAMB", "FusedAdam", "FusedLamb"]
