"""`deepspeed.runtime.zero`: the names scripts import from it (`partition_parameters.ZeroParamStatus`,
`offload_config.OffloadDeviceEnum` / `OffloadStateTypeEnum`).

Modules:
    offload_config.py        `deepspeed.runtime.zero.offload_config`: the two enums scripts import from it.
    partition_parameters.py  `deepspeed.runtime.zero.partition_parameters`: `ZeroParamStatus`, DeepSpeed's stage-3 ...
"""

from . import offload_config, partition_parameters

__all__ = ["offload_config", "partition_parameters"]
