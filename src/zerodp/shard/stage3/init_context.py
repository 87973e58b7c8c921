"""`init_context`: build a model whose parameters are partitioned from the moment they exist.

    with zerodp.init_context(config):
        model = GPT(cfg)          # every rank keeps 1/N of each parameter; none holds the model
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), config)

[Note: partitioned at creation]
While the block runs, a module-parameter registration hook (torch's public global hook, removed
on exit) takes each new parameter as it is assigned to a module, keeps this rank's 1/N slice of
its values (padded to a multiple of N, per parameter) and releases the rest: the parameter keeps
its shape and becomes a `PartitionedParameter` (see [Note: partitioned parameters]). Peak memory
is the model's shards plus one full parameter, never the model.

Initialization code that runs later in the block (`reset_parameters`, `nn.init.*`, a model's own
`_init_weights`) touches partitioned parameters; each such access gathers the parameter whole
(all-gather of its slices), runs the operation, and keeps it whole until another parameter is
touched, at which point it is partitioned again: rank 0's values are broadcast first, so ranks
that drew different random numbers still agree. Every rank therefore draws the same random
numbers on full-size tensors as a plain construction would: a model built here equals, value for
value, the same model built without it from the same seed. Under NCCL the slices and the gathered
parameters live on the rank's GPU (NCCL gathers CUDA tensors only; [Note: a CPU-built model under
NCCL] in zerodp/comm/module_device.py), so initializers draw from the CUDA generator, as under DeepSpeed's
zero.Init: the model equals the same model built on that GPU.

On exit the slices are converted to the compute dtype (bf16/fp16 in the config), so that the
engine's `model.to(dtype)` has nothing left to do for them. `zerodp.initialize` then lays the
parameters out in units, gathering one parameter at a time into each unit's flat buffer. The
engine must be built on the same ranks (`process_group`) and with a stage-3 config.

With `offload_param` in the config, each slice goes to its offloaded home (a file under nvme_path)
the moment it is made and is read back only while an initializer or the engine's layout needs it,
so a rank holds at most `max_in_cpu` elements of slices plus one full parameter (as DeepSpeed's
`zero.Init(remote_device="nvme")`); the engine's flat units then adopt their shards the same way.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional

import torch
from torch import nn

from ... import comm
from ...config import ConfigError, load_config
from ...host_memory import alloc_storage, free_storage
from ...comm.module_device import rank_training_device
from ...offload.tier import build_param_offload
from ...precision.policy import PrecisionPolicy
from .params import PartitionedParameter, owner_of, register_owner, set_partitioned, unregister_owner


class _InitShard:
    """This rank's slice of one parameter created under `init_context`, and its padded buffer."""

    def __init__(self, param: nn.Parameter, ctx: "_InitContext") -> None:
        self.ctx = ctx
        self._param = weakref.ref(param)  # a parameter replaced during construction (a tie) may die
        self.module_name = "<init_context>"
        self.cls = type(param)
        numel, world = param.numel(), ctx.world
        self.padded_numel = -(-numel // world) * world
        shard_numel = self.padded_numel // world
        lo = ctx.rank * shard_numel
        flat = param.detach().reshape(-1)
        device = ctx.device or param.device  # NCCL: the rank's GPU, whatever the parameter was built on
        self.shard = torch.zeros(shard_numel, dtype=param.dtype, device=device)
        mine = flat[lo:min(lo + shard_numel, numel)]
        self.shard[:mine.numel()].copy_(mine)
        if ctx.param_home is not None:  # offload_param: the slice goes to its offloaded home at once
            ctx.param_home.adopt(self.shard)
        self.full = torch.empty(self.padded_numel, dtype=param.dtype, device=device)
        param.data = self.full[:numel].view(param.shape)  # drops the parameter's own storage
        free_storage(self.full)
        set_partitioned([param], None)
        self.whole = False

    def _resident(self, dirty: bool = False):
        """offload_param: hold the slice in memory for a block (offload/shard_store.py)."""
        home = self.ctx.param_home
        return contextlib.nullcontext() if home is None else home.resident([self.shard], dirty=dirty)

    @property
    def param(self) -> Optional[nn.Parameter]:
        return self._param()

    def name_of(self, param) -> str:
        return "<a parameter created under zerodp.init_context>"

    # -- gathering during initialization ----------------------------------------------------------

    def gather(self) -> None:
        alloc_storage(self.full, self.padded_numel)
        with self._resident():
            comm.all_gather(self.full, self.shard, self.ctx.group, tag="param")
        set_partitioned([self.param], [self.cls])
        self.whole = True

    def partition(self, src: Optional[int] = 0) -> None:
        """Keep rank `src`'s values (random initializers may differ per rank) and release the rest;
        `src=None`: keep this rank's slice as it was (a read-only gather, nothing written back)."""
        if src is None:
            set_partitioned([self.param], None)
            free_storage(self.full)
            self.whole = False
            return
        comm.broadcast(self.full, src, self.ctx.group, tag="param")
        lo = self.ctx.rank * self.shard.numel()
        with self._resident(dirty=True):
            self.shard.copy_(self.full[lo:lo + self.shard.numel()])
        set_partitioned([self.param], None)
        free_storage(self.full)
        self.whole = False

    # -- handing over to the engine ---------------------------------------------------------------

    def to_dtype(self, dtype: torch.dtype) -> None:
        """Convert the slice (and the shape-keeping placeholder) to the compute dtype."""
        if dtype == self.shard.dtype or not self.param.is_floating_point():
            return
        with self._resident():
            converted = self.shard.to(dtype)
        if self.ctx.param_home is not None:
            self.ctx.param_home.discard(self.shard)
            self.ctx.param_home.adopt(converted)
        self.shard = converted
        self.full = torch.empty(self.padded_numel, dtype=dtype, device=self.shard.device)
        set_partitioned([self.param], [self.cls])
        self.param.data = self.full[:self.param.numel()].view(self.param.shape)  # a view needs the bytes...
        set_partitioned([self.param], None)
        free_storage(self.full)  # ...which go right after

    def gather_into(self, out: torch.Tensor) -> None:
        """Write the whole parameter into `out` (a collective) and forget this record."""
        self.gather()
        out.copy_(self.full[:self.param.numel()].view(out.shape))
        free_storage(self.full)
        unregister_owner(self.param)
        self.ctx.handed_over(self)


class _InitContext:
    def __init__(self, group: comm.ProcessGroup, threshold: int, dtype: torch.dtype, param_home=None) -> None:
        self.group = group
        # offload_param: an offload.ShardStore holding the slices until the engine takes them over
        self.param_home = param_home
        self.rank = comm.get_rank(group)
        self.world = comm.get_world_size(group)
        self.threshold = threshold
        self.dtype = dtype
        # where slices are made: under NCCL the rank's GPU ([Note: a CPU-built model under NCCL]); offload_param
        # keeps them in their offloaded home on the host; else (None) the device each parameter was built on
        self.device = rank_training_device(group) if param_home is None else None
        self.active = True
        self.shards: list[_InitShard] = []
        self._whole: list[_InitShard] = []

    def on_register(self, module: nn.Module, name: str, param: Optional[nn.Parameter]):
        if param is None or isinstance(param, PartitionedParameter) or owner_of(param) is not None:
            return None  # absent, or already partitioned (a tied weight assigned a second time)
        if param.numel() < self.threshold:
            return None  # stays whole: the engine keeps it whole anyway (persistent)
        shard = _InitShard(param, self)
        register_owner(param, shard, self)
        self.shards.append(shard)
        return None

    def gather_on_access(self, owner: _InitShard, owners: list) -> bool:
        """A parameter built sharded was read during the block: make it (and the op's others) whole."""
        if not self.active:
            return False
        self.make_whole([o for o in owners if isinstance(o, _InitShard)])
        return True

    def make_whole(self, shards: list[_InitShard]) -> None:
        """Gather `shards`; partition again whatever else was whole (one parameter at a time)."""
        for s in [s for s in self._whole if s not in shards]:
            if s.param is not None:  # the same on every rank: a parameter dies at the same line everywhere
                s.partition()
        self._whole = [s for s in self._whole if s in shards]
        for s in shards:
            if not s.whole:
                s.gather()
                self._whole.append(s)

    def gather_for_block(self, shards: list[_InitShard]) -> None:
        """`gathered_parameters` over parameters built here and not yet in an engine (transformers
        initializes and loads a checkpoint into them that way after the block, as for DeepSpeed's
        zero.Init): gather `shards` whole, partitioning again whatever else was whole."""
        self.make_whole(shards)

    def release_after_block(self, shards: list[_InitShard], modifier_rank: Optional[int]) -> None:
        """End of that block: every rank keeps its slice of `modifier_rank`'s values (None: of its own,
        the block's writes discarded, as gathered_parameters documents)."""
        for s in shards:
            if s.whole:
                s.partition(modifier_rank)
        self._whole = [s for s in self._whole if s not in shards]

    def handed_over(self, shard: _InitShard) -> None:
        """The engine took `shard`'s values into a flat unit: drop the slice (and, after the last, the files)."""
        if self.param_home is None:
            return
        self.param_home.discard(shard.shard)
        if not self.param_home.entries:
            self.param_home.close()

    def close(self) -> None:
        self.make_whole([])
        self.active = False
        alive = [s for s in self.shards if s.param is not None and owner_of(s.param) is s]  # ties replaced some
        if self.param_home is not None:
            for s in self.shards:
                if s not in alive:
                    self.param_home.discard(s.shard)
        for s in alive:
            s.to_dtype(self.dtype)
        self.shards = alive


@contextlib.contextmanager
def init_context(config, process_group: comm.ProcessGroup = None) -> Iterator[None]:
    """Partition every parameter created in the block across `process_group` (see the module docstring).

    `config` is the stage-3 config the engine will be built with (a dict, a path or a ZeroConfig).
    """
    cfg = load_config(config)
    if cfg.stage != 3:
        raise ConfigError(f"zerodp.init_context partitions parameters for ZeRO stage 3, but the config says "
                          f"stage {cfg.stage}; set zero_optimization.stage to 3")
    comm.init_distributed()
    # offload_param: slices are written to their offloaded home as they are made (the model's size is not
    # known yet, so the up-front disk check only sees that nvme_path is a writable directory)
    param_home = build_param_offload(cfg, 0, 1, 0, process_group)
    ctx = _InitContext(process_group, cfg.zero_optimization.stage3_param_persistence_threshold,
                       PrecisionPolicy.from_config(cfg).param_dtype, param_home)
    handle = nn.modules.module.register_module_parameter_registration_hook(ctx.on_register)
    finished = False
    try:
        yield
        finished = True
    finally:
        handle.remove()
        if finished:
            ctx.close()  # collectives: skipped if the block raised (other ranks may not be here)
        else:
            ctx.active = False
