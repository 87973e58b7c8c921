"""`deepspeed.runtime.zero`: the names scripts import from it (`partition_parameters.ZeroParamStatus`,
`offload_config.OffloadDeviceEnum` / `OffloadStateTypeEnum`)."""

from . import offload_config, partition_parameters

__all__ = ["offload_config", "partition_parameters"]
