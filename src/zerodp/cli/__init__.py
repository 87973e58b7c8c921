"""The `zerodp` command (`main.py`): train, estimate, consolidate. `python -m zerodp` runs it too."""

from .main import TRAIN_OPTIONS, build_parser, main

__all__ = ["main", "build_parser", "TRAIN_OPTIONS"]
