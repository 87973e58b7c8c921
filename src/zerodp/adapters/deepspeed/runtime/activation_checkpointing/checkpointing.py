"""`deepspeed.runtime.activation_checkpointing.checkpointing`: the same module as `deepspeed.checkpointing`
(zerodp/adapters/deepspeed/checkpointing.py); every name there is re-exported here."""

from ...checkpointing import *  # noqa: F401,F403 (DeepSpeed's public names, listed in its __all__)
from ...checkpointing import __all__  # noqa: F401
