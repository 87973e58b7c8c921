"""`deepspeed.runtime.zero.partition_parameters`: `ZeroParamStatus`, DeepSpeed's stage-3 parameter states,
and the constructor-wrapper names transformers swaps around `zero.Init`.

DeepSpeed-Chat imports `ZeroParamStatus` to test `param.ds_status == ZeroParamStatus.NOT_AVAILABLE` on
parameters that carry DeepSpeed's `ds_id`. zerodp keeps no state on parameters (`hasattr(p, "ds_id")` is
false), so such code takes its plain-parameter branch; gather stage-3 parameters with
`deepspeed.zero.GatheredParameters`.

DeepSpeed's `zero.Init` replaces torch's tensor constructors with wrappers made by
`zero_wrapper_for_fp_tensor_constructor` (new floating tensors in the config's dtype, on the accelerator),
and transformers' `prevent_arange_dtype_change` swaps that function for one sparing `torch.arange` around
every `from_pretrained` under ZeRO-3. zerodp's `zero.Init` wraps no constructor (it partitions parameters
as modules register them, and converts them to the compute dtype on exit), so it never calls the function:
the name exists for code that swaps it, and calling it says that nothing is wrapped here.
"""

from enum import Enum

import torch


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # whole on every rank
    NOT_AVAILABLE = 2  # sharded
    INFLIGHT = 3  # being gathered


# the unwrapped constructor, as DeepSpeed names it (transformers compares a wrapped function with it)
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """Never called by zerodp (see the module docstring); calling it is an error naming why."""
    raise NotImplementedError("zero_wrapper_for_fp_tensor_constructor: zerodp's zero.Init does not wrap torch's "
                              "tensor constructors (parameters are partitioned as modules register them, and "
                              "converted to the config's dtype when the block ends); there is nothing to wrap")
