"""Where each state of a training run lives, decided once from the config and the model's device: `Placement`.

One answer per kind of tensor (a `Home`: device, dtype, pinned host memory or not, files at rest or not):

    compute         the parameters the model computes with (gathered stage-3 units, stage 0-2 buffers)
    grads           gradient buffers as backward fills them and the reductions sum them
    param_shards    this rank's parameter shard at rest (stage 3 offload_param: host memory or files)
    grad_shards     the reduced gradient shard at rest (files: fp32 training with offload_param nvme)
    masters         the fp32 master shards the optimizer updates
    states          the optimizer's elementwise state at rest (offload_optimizer: host memory or files)
    grad_staging    what a reduced gradient shard's copy to the host carries for a step there: the shard's
                    own dtype, pinned (the step reads it widened to the masters' dtype on the host)
    param_staging   the host buffer updated parameters are cast into before their copy to the GPU

Without offload everything lives on the model's device. ZeRO-Offload (`offload_optimizer`) on a GPU
keeps the 16-bit parameters and the compute on the GPU and moves the optimizer to the host: masters and
states live there and are stepped there (nvme: states in files, streamed through the step); the
reduced gradient shard is copied, in its own dtype, into a pinned host buffer before the step (and widened
to fp32 there), and the updated parameters are cast into a pinned host buffer and copied back.
`offload_param` moves stage 3's parameter shards between uses (pinned host memory for `cpu`, files for
`nvme`) and leaves the masters where offload_optimizer puts them. On a machine whose model is on the CPU,
host memory is the only memory: `cpu` offload moves nothing (the offload code paths still run: nvme
streams its files).

Everything that needs a device takes it from here (the optimizer's masters and step, the offload
stores' pinning, the checkpoint's collectives), so nobody guesses one from a neighbouring tensor. A
device is a value: `placement_of(config, torch.device("cuda", 0))` answers on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import ZeroConfig
from ..config.offload import OffloadDevice
from ..precision.policy import PrecisionPolicy

HOST = torch.device("cpu")


@dataclass(frozen=True)
class Home:
    """Where one kind of tensor lives: its device (where it is used or held while resident), dtype, whether
    it is page-locked host memory (asynchronous copies to and from a GPU), and whether it rests in files."""

    device: torch.device
    dtype: torch.dtype
    pinned: bool = False
    files: bool = False


@dataclass(frozen=True)
class Placement:
    """The answers for one engine; see the module docstring."""

    compute: Home
    grads: Home
    param_shards: Home
    grad_shards: Home
    masters: Home
    states: Home
    grad_staging: Optional[Home]   # None: the step reads the gradient shard where it is
    param_staging: Optional[Home]  # None: masters are written into the parameter shards directly (or are them)
    masters_are_shards: bool       # the master *is* the parameter shard (fp32, one device): updated in place
    # stages 2-3: each round's gradient buffer is zeroed when allocated and autograd adds into its views
    # ([Note: gradients as buffer views] in grads/grad_shard.py); False: each first gradient is copied in
    round_grad_views: bool

    @property
    def steps_on_host(self) -> bool:
        """The optimizer steps on the host while the model computes on another device (ZeRO-Offload)."""
        return self.masters.device != self.compute.device

    @property
    def param_shards_offloaded(self) -> bool:
        """Stage-3 parameter shards leave the compute memory between uses (a `ShardStore` holds them)."""
        return self.param_shards.files or self.param_shards.device != self.compute.device

    @property
    def grad_shards_offloaded(self) -> bool:
        return self.grad_shards.files


def grad_views_every_round(device: torch.device) -> bool:
    """Whether stages 2-3 zero each round's gradient buffer so that autograd accumulates into its views
    ([Note: gradients as buffer views] in grads/grad_shard.py): on an accelerator, where the zeroing is a
    memset beside the step's kernels and the host work it saves per parameter (a copy and a `.grad` reset
    in the gradient hook) is what a host-bound step waits for; not on the CPU, where the zeroing and the
    in-place add are two more passes over a large model's gradients in memory bandwidth (the copy path
    writes each gradient once)."""
    return torch.device(device).type != "cpu"


def model_device(model: torch.nn.Module) -> torch.device:
    """The device the model computes on: its first parameter's (the CPU for a model without any)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else HOST


def placement_for_precision(precision: PrecisionPolicy, device: torch.device) -> Placement:
    """Nothing offloaded: every state on `device`, in `precision`'s dtypes."""
    compute = Home(torch.device(device), precision.param_dtype)
    grads = Home(compute.device, precision.grad_accum_dtype or precision.param_dtype)
    masters = Home(compute.device, precision.master_dtype)
    return Placement(compute, grads, compute, grads, masters, masters, None, None,
                     masters_are_shards=masters.dtype == compute.dtype,
                     round_grad_views=grad_views_every_round(compute.device))


def placement_of(config: ZeroConfig, device: torch.device) -> Placement:
    """Where each state lives for `config` on a model computing on `device` (see the module docstring)."""
    device = torch.device(device)
    zero = config.zero_optimization
    precision = PrecisionPolicy.from_config(config)
    on_gpu = device.type != "cpu"  # pinned memory only speeds up copies to and from an accelerator
    param_dtype = precision.param_dtype
    grad_dtype = precision.grad_accum_dtype or param_dtype
    compute = Home(device, param_dtype)
    grads = Home(device, grad_dtype)

    offload_param = zero.offload_param if config.stage == 3 else None
    param_shards, grad_shards = compute, grads
    if offload_param is not None and offload_param.device is OffloadDevice.NVME:
        # read into compute memory (through host I/O buffers) while used; fp32 gradient shards follow them
        param_shards = Home(device, param_dtype, offload_param.pin_memory and on_gpu, files=True)
        if not precision.mixed:  # mixed precision: the step converts the gradient shards whole, they stay
            grad_shards = Home(device, grad_dtype, files=True)
    elif offload_param is not None and offload_param.device is OffloadDevice.CPU and on_gpu:
        param_shards = Home(HOST, param_dtype, offload_param.pin_memory)

    section = zero.offload_optimizer
    offloaded = section.enabled and config.stage >= 1
    step_device = HOST if offloaded else device
    masters = Home(step_device, precision.master_dtype)
    states = Home(step_device, precision.master_dtype, section.pin_memory and on_gpu and offloaded,
                  files=offloaded and section.device is OffloadDevice.NVME)
    host_step = step_device != device
    # A step on the host reads its gradients from, and sends its parameters through, page-locked buffers:
    # a copy from pageable memory is staged by the driver and blocks the host; from pinned memory it is one
    # DMA that may overlap other work.
    # The gradient copy carries the shard's own dtype (2 bytes per element in bf16/fp16, not an fp32 conversion
    # made on the GPU first); the host widens it, exactly, for the step (optim/grad_staging.py [Note: 16-bit
    # copies, widened on the host]).
    grad_staging = Home(HOST, grad_dtype, pinned=True) if host_step else None
    param_staging = Home(HOST, param_dtype, pinned=True) if host_step else None
    return Placement(compute, grads, param_shards, grad_shards, masters, states, grad_staging, param_staging,
                     masters_are_shards=masters.device == device and masters.dtype == param_dtype,
                     round_grad_views=grad_views_every_round(device))
