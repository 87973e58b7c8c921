"""`deepspeed.runtime.activation_checkpointing`: where DeepSpeed's checkpointing module lives (Megatron
imports it from here as well as from `deepspeed.checkpointing`)."""

from . import checkpointing

__all__ = ["checkpointing"]
