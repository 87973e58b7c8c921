"""`deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`, DeepSpeed's stage-3 parameter states.

DeepSpeed-Chat imports it to test `param.ds_status == ZeroParamStatus.NOT_AVAILABLE` on parameters that
carry DeepSpeed's `ds_id`. zerodp keeps no state on parameters (`hasattr(p, "ds_id")` is false), so such
code takes its plain-parameter branch; gather stage-3 parameters with `deepspeed.zero.GatheredParameters`.
"""

from enum import Enum


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # whole on every rank
    NOT_AVAILABLE = 2  # sharded
    INFLIGHT = 3  # being gathered
