"""`deepspeed.runtime.zero`: the names scripts import from it (`partition_parameters.ZeroParamStatus`)."""

from . import partition_parameters

__all__ = ["partition_parameters"]
