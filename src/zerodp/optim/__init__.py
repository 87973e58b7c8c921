"""Optimizers that stay exact on ZeRO's flat shards, and how zerodp rebuilds the user's optimizer."""

from .lamb import LAMB
from .larc import LARC

__all__ = ["LARC", "LAMB"]
