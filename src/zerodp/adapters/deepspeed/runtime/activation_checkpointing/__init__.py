"""`deepspeed.runtime.activation_checkpointing`: where DeepSpeed's checkpointing module lives (Megatron
imports it from here as well as from `deepspeed.checkpointing`).

Modules:
    checkpointing.py  `deepspeed.runtime.activation_checkpointing.checkpointing`: the same module as ...
"""

from . import checkpointing

__all__ = ["checkpointing"]
