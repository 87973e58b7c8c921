"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: a state dict's tensors copied for `torch.save`.

Accelerate's `get_state_dict` (stages 0-2) passes the module's state dict through it before saving: each tensor
becomes a detached copy of its own storage (so `torch.save` writes only that tensor, not the whole flat buffer a
view of it may point into, as zerodp's parameters are), on `device` (CPU by default). Lists, tuples and dicts
(of any mapping type: OrderedDict stays OrderedDict) are copied recursively; anything else is returned as is.
"""

from __future__ import annotations

from typing import Any, Union

import torch


def clone_tensors_for_torch_save(item: Any, device: Union[str, torch.device] = torch.device("cpu")) -> Any:
    device = torch.device(device)
    if torch.is_tensor(item):
        # .to() of a tensor already there would return it unchanged: clone it then, so the storage is its own
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
