"""The device a rank's model trains on, and moving a model built on the CPU there.

[Note: a CPU-built model under NCCL] NCCL's collectives take CUDA tensors only, and torchrun scripts
(DeepSpeed's and the README's) build their model on the CPU: DeepSpeed's engine moves it to
`cuda:LOCAL_RANK`. zerodp's rule, for `zerodp.initialize`, the DeepSpeed adapter and `init_context`:

    when the process group is NCCL (or DeepSpeed's "cpu:gloo,cuda:nccl"), every parameter and buffer
    on the CPU is moved to cuda:LOCAL_RANK;
    on any other backend (gloo), or without a process group, nothing moves.

So a CPU run changes in nothing (gloo), and a single process without torchrun trains where the script
put the model, as plain PyTorch would. Tensors already on a GPU stay where they are; a parameter
partitioned by `init_context` holds no storage of its own here (its shard was made on the rank's device).
The move keeps every `nn.Parameter` object (`param.data` is replaced), so an optimizer built over
`model.parameters()` before `initialize` still holds the model's parameters.

The decision is `training_device(backend, local_rank)`: data in, a device out, tested on CPU with
`torch.device("cuda", 0)` values.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import comm
from . import launch_env
from .backend import nccl_serves_cuda


def training_device(backend: str, local_rank: int) -> Optional[torch.device]:
    """The device CPU tensors must move to under `backend` (NCCL, also as "cpu:gloo,cuda:nccl":
    cuda:local_rank), or None: leave them."""
    return torch.device("cuda", local_rank) if nccl_serves_cuda(backend) else None


def rank_training_device(process_group: comm.ProcessGroup = None) -> Optional[torch.device]:
    """`training_device` of this process: the group's backend, its launcher's local rank (comm/launch_env.py)."""
    return training_device(comm.backend_name(process_group), launch_env.local_rank())


def _holds_no_storage(param: torch.Tensor) -> bool:
    """A parameter partitioned by init_context (its shard lives elsewhere): a view of freed storage."""
    return param.numel() > 0 and param.untyped_storage().nbytes() == 0


def _move_in_place(param: nn.Parameter, moved: torch.Tensor) -> None:
    """Give `param` the values of `moved` keeping the Python object, so optimizers built over it still hold it.
    CPU -> CUDA: `param.data = moved` (as nn.Module.to does); a device whose tensors cannot share a Parameter
    with CPU ones (meta) swaps the tensors' contents instead."""
    if torch._has_compatible_shallow_copy_type(param.data, moved):
        param.data = moved
    else:
        param.grad = None
        torch.utils.swap_tensors(param, nn.Parameter(moved, requires_grad=param.requires_grad))


def move_cpu_tensors(model: nn.Module, device: torch.device) -> int:
    """Move `model`'s CPU parameters (with their gradients) and buffers to `device`, keeping each Parameter
    object; returns the number of tensors moved."""
    moved = 0
    for module in model.modules():
        for param in module._parameters.values():
            if param is None or param.device.type != "cpu" or _holds_no_storage(param):
                continue
            grad = None if param.grad is None else param.grad.to(device)
            _move_in_place(param, param.data.to(device))
            param.grad = grad
            moved += 1
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type == "cpu":
                module._buffers[name] = buf.to(device)
                moved += 1
    return moved


def place_module(model: nn.Module, process_group: comm.ProcessGroup = None) -> Optional[torch.device]:
    """Apply the rule of [Note: a CPU-built model under NCCL] to `model`; returns the device moved to, if any."""
    device = rank_training_device(process_group)
    if device is None:
        return None
    move_cpu_tensors(model, device)
    return device
