"""`deepspeed.checkpoint`: the helper Accelerate imports when it saves a model's weights (`utils`).

Modules:
    utils.py  `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: a state dict's tensors copied for ...
"""

from . import utils

__all__ = ["utils"]
