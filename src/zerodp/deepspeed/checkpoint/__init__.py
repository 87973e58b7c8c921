"""`deepspeed.checkpoint`: the helper Accelerate imports when it saves a model's weights (`utils`)."""

from . import utils

__all__ = ["utils"]
