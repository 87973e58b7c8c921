"""DeepSpeed's training API over zerodp. A DeepSpeed script switches by changing one import line,

    import zerodp.deepspeed as deepspeed        # was: import deepspeed

or runs unchanged, its `import deepspeed` / `from deepspeed.X import Y` resolved to this package by

    torchrun --nproc_per_node 2 -m zerodp.deepspeed.run train.py ARGS     (alias.py, run.py)

and keeps `deepspeed.initialize(args=..., model=..., model_parameters=..., config=...)`,
`engine.backward(loss)`, `engine.step()`, `engine.save_checkpoint(dir, client_state=...)`,
`engine.load_checkpoint(dir)`, `deepspeed.zero.Init`, `deepspeed.comm.get_rank()`, ...

What real scripts import and call (counted in DeepSpeedExamples' training/ and DeepSpeed-Chat, and
DeepSpeed's examples/; transformers' and accelerate's integrations add the last rows):

    import / call                                          uses  here
    deepspeed.initialize / add_config_arguments /            35+  engine.py, this file
      init_distributed
    deepspeed.comm as dist: get_rank, get_world_size,       38+  comm.py (collectives are torch's,
      barrier, new_group, all_reduce, broadcast, gather, ...       DeepSpeed's logging keywords dropped)
    deepspeed.accelerator.get_accelerator (also `from         18  accelerator.py
      deepspeed import get_accelerator`): device_name 15,
      set_device 5, memory_allocated 5, current_device_name 3,
      max_memory_*/memory_reserved/reset_peak_memory_stats 2,
      is_available 2, device_count 2, manual_seed_all 1
    deepspeed.zero.GatheredParameters / zero.Init              8  zero.py
    deepspeed.ops.adam.DeepSpeedCPUAdam / FusedAdam            6  ops/adam (torch's Adam/AdamW)
    deepspeed.utils: logger, log_dist, RepeatingLoader,        4  utils/
      safe_get_full_*; utils.logging.logger
    deepspeed.moe.utils.split_params_into_different_moe_       1  moe/utils.py (dense: groups
      groups_for_optimizer; deepspeed.moe.layer.MoE                 unchanged; MoE refused when called)
    deepspeed.runtime.utils: set_random_seed, see_memory_usage 1  runtime/utils.py
    deepspeed.runtime.zero.partition_parameters.ZeroParamStatus 2 runtime/zero/ (the enum; zerodp's
                                                                   parameters carry no ds_status)
    deepspeed.runtime.zero.offload_config: OffloadDeviceEnum,  1  runtime/zero/offload_config.py;
      OffloadStateTypeEnum; engine.offload_states/reload_states   engine.py (CPU: nothing to move)
    engine.compile()                                           1  engine.py (module.compile)
    deepspeed.compression.helper: recursive_getattr/setattr    1  compression/helper.py (DeepSpeed-Chat's LoRA)
    initialize(model=, config=) without an optimizer           1  forward_engine.py (DPO's reference model;
                                                                   at stage 3 sharded by stage 3's strategy)
    engine.<module attribute> (engine.model, ...),              1  engine.py (DeepSpeed's engine answers with
      engine.tput_timer.update_epoch_count()                       its module's attributes); utils/timer.py
    launcher's --local_rank=<n> argument                        3  run.py --local_rank (DeepSpeed-Chat)
    HF Accelerate and the stock Trainer (issue 35):                  engine.py, consolidated_weights.py,
      backward(loss, scale_wrt_gas=False),                           runtime/lr_schedules.py,
      set_gradient_accumulation_boundary, engine.config (a dict),    checkpoint/utils.py, ops/adagrad, ops/lion,
      runtime.lr_schedules.VALID_LR_SCHEDULES, steps_per_print inf,  utils/zero_to_fp32.py, utils/z3_leaf.py;
      checkpoint.utils.clone_tensors_for_torch_save,                 a scheduler on the user's optimizer:
      zero_gather_16bit_weights_on_model_save,                       optim/shared_groups.py
      _zero3_consolidated_16bit_state_dict, ops DeepSpeedCPUAdam/
      DeepSpeedCPUAdagrad/DeepSpeedCPULion, utils.zero_to_fp32,
      utils.set_z3_leaf_modules
    not provided (import fails naming the module): deepspeed.pipe, ops.sparse_attention,
      DeepSpeedTransformerLayer, module_inject, runtime.data_pipeline,
      compression (but its helper), comm.mori (refused naming it), init_inference, tp_model_init

This package is a thin adapter: the engine, the config (DeepSpeed's keys, `config.compat`), the
optimizers (`optim.deepspeed_types`) and the schedules (`optim.lr_schedules`) are zerodp's own.

Where zerodp differs from DeepSpeed on purpose (the engine's differences are in engine.py):
  - `zero.Init`: DeepSpeed's parameters are empty while a Hugging Face model runs its weight
    initialization (unless the script made an `HfDeepSpeedConfig`), so DeepSpeed trains torch's default
    initialization; zerodp's parameters keep their shapes, so the model's own initialization applies
    and the run equals plain PyTorch. Modules that initialize without HF (the collected scripts) start
    from the same weights in both.
  - `init_distributed(dist_backend="cpu:gloo,cuda:nccl")`: DeepSpeed hands the list to torch, which fails
    on a build without NCCL or a machine without a GPU; zerodp keeps NCCL only where a GPU is visible, so
    the script runs on CPU.
  - `ops.adam.FusedAdam` / `DeepSpeedCPUAdam` (and `ops.adagrad`, `ops.lion`) return torch optimizers or
    zerodp's Lion (the same update), so `isinstance(opt, FusedAdam)` does not work; their state lives where
    the config's offload_optimizer puts it.
  - parameters carry no `ds_numel`/`ds_id`: a partitioned parameter keeps its shape, so `p.numel()` is the
    whole count (transformers counts `p.ds_numel if hasattr(p, "ds_numel") else p.numel()`).
  - inputs: zerodp's own engine casts floating inputs to the compute dtype; through this adapter they are
    cast only where DeepSpeed casts them (fp16 with `auto_cast: true`), so an fp32 tensor a bf16 model adds
    to its activations promotes the result to fp32 as in DeepSpeed.
  - `get_accelerator().device_count()` on CPU is LOCAL_SIZE or 1 (DeepSpeed counts NUMA nodes).
  - `initialize` without an optimizer (no argument, no config section) returns a forward-only engine
    (forward_engine.py): the module in the compute dtype, as DeepSpeed's; at stage 3 its parameters stay
    sharded (stage 3's strategy, every parameter frozen) and its forward runs under `torch.no_grad()` (no
    graph: DeepSpeed's would only reach parameters nothing steps); its `backward`/`step` are refused.
  - transformers' `HfDeepSpeedConfig` asks `importlib.metadata` for the `deepspeed` distribution: under
    `zerodp.deepspeed.run`'s alias (alias.py) zerodp answers as DeepSpeed 0.19.8, so a script creating one
    (DeepSpeed-Chat at stage 3) builds its model under `zero.Init` and loads the checkpoint through
    `GatheredParameters` (rank 0 writes, every rank keeps its slice), as with DeepSpeed; the model's
    `state_dict()` before `initialize` holds meta tensors (names, shapes, dtypes) where DeepSpeed's holds
    empty placeholders. A script that
    imports `zerodp.deepspeed` itself is not such an alias: there transformers finds no DeepSpeed, and the
    model is built whole and partitioned in `initialize`, with the same weights (see `zero.Init` above).
  - `runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor` exists (transformers swaps
    it around `from_pretrained`) but zerodp's `zero.Init` wraps no torch constructor, so never calls it.

Modules:
    accelerator.py           `deepspeed.accelerator.get_accelerator()`: the device object DeepSpeed scripts ask for the ...
    alias.py                 Run a DeepSpeed script unchanged: make `import deepspeed` and `from deepspeed.X import Y` ...
    checkpoint/              `deepspeed.checkpoint`: the helper Accelerate imports when it saves a model's weights ...
    checkpoint_files.py      DeepSpeed's file names in a zerodp checkpoint, for tools that open a DeepSpeed checkpoint's ...
    checkpointing.py         DeepSpeed's `deepspeed.checkpointing` (runtime/activation_checkpointing/checkpointing.py): the ...
    comm.py                  `deepspeed.comm`'s common calls, over torch.distributed (world size 1 without a process group).
    compression/             `deepspeed.compression`: only `helper`'s two module-path helpers, which DeepSpeed-Chat's LoRA ...
    consolidated_weights.py  The whole model's weights on demand, as DeepSpeed's engine hands them to Accelerate and the HF ...
    engine.py                `DeepSpeedEngine`: DeepSpeed's engine methods over a `ZeroEngine`.
    forward_engine.py        `ForwardEngine`: what `deepspeed.initialize(model=m, config=c)` returns when there is nothing ...
    launcher/                `deepspeed.launcher`: what launchers read from DeepSpeed's (runner.py); DeepSpeed's own ...
    moe/                     `deepspeed.moe`: the parameter-group helper dense scripts call; DeepSpeed's MoE layers are ...
    ops/                     `deepspeed.ops`: the optimizer names scripts and Accelerate import (`adam`, `adagrad`, ...
    run.py                   `python -m zerodp.deepspeed.run script.py ARGS`: run an unchanged DeepSpeed script on zerodp.
    runtime/                 `deepspeed.runtime`: the helpers scripts import from it (`utils`, `dataloader`, `zero`, ...
    utils/                   `deepspeed.utils`: the logger, `log_dist`, `RepeatingLoader`, the safe getters of whole ...
    zero.py                  `deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters` over zerodp's stage-3 ...
    zero_optimizer.py        `ZeroOptimizer`: the optimizer `deepspeed.initialize` returns, as frameworks use DeepSpeed's ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from ... import comm as _comm
from ...comm.launch_env import LaunchEnvironment, export_torch_variables, read_launch_environment
from ...errors import LaunchError
from ...config import ConfigError, load_config
from ...engine.zero_engine import initialize as zerodp_initialize
from ...optim.inner import build_from_section, build_from_sections
from . import accelerator, checkpoint, checkpointing, comm, moe, ops, runtime, utils, zero
from .accelerator import get_accelerator
from .engine import DeepSpeedEngine
from .forward_engine import ForwardEngine
from .utils.z3_leaf import leaf_unit_modules

__all__ = ["initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine", "get_accelerator",
           "accelerator", "checkpoint", "comm", "moe", "ops", "runtime", "utils", "zero"]


# DeepSpeed's top-level names that zerodp does not provide, with what they are (PEP 562 `__getattr__`)
_NOT_PROVIDED = {
    "init_inference": "DeepSpeed-Inference", "tp_model_init": "tensor parallelism",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels",
    "replace_transformer_layer": "DeepSpeed's kernel injection", "PipelineModule": "pipeline parallelism",
    "DeepSpeedConfig": "DeepSpeed's config object (zerodp.load_config reads the same JSON)",
}


def __getattr__(name: str):
    if name in _NOT_PROVIDED:
        raise AttributeError(f"deepspeed.{name} ({_NOT_PROVIDED[name]}) is not provided by zerodp.deepspeed")
    raise AttributeError(f"module 'zerodp.deepspeed' has no attribute {name!r}")


def _usable_backend(dist_backend: str) -> str:
    """`dist_backend` without the `device:backend` entries that cannot serve this process (comm/backend.py).

    DeepSpeed passes "cpu:gloo,cuda:nccl" to torch, which fails on a CPU-only build ("doesn't have NCCL
    built in") and, on a CUDA build without a GPU, at group creation ("no GPUs found"); zerodp keeps NCCL
    only where a GPU is visible, so such a script runs on CPU ([Note: NCCL built is not a GPU present]).
    A plain backend name ("nccl") is passed as given: asking for it where it cannot serve fails.
    """
    return _comm.usable_backend(dist_backend)


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout=None, init_method=None,
                     dist_init_required=None, config=None, rank: int = -1, world_size: int = -1) -> None:
    """Initialize torch.distributed from the launch environment (gloo on CPU, NCCL on GPU) if not done yet.

    `auto_mpi_discovery=True` (DeepSpeed's default): without torchrun's variables, a process started by srun or
    mpirun joins the world its launcher made, read from the launcher's variables (DeepSpeed asks mpi4py; zerodp
    reads SLURM's, Open MPI's and MPICH's environment: comm/launch_env.py), with `distributed_port` as the
    rendezvous port unless MASTER_PORT is set. `auto_mpi_discovery=False`: such a process is refused (it would
    otherwise train alone) with the variables seen and the fix. `rank`/`world_size`, if given, must be the
    environment's; an `init_method` other than env:// is refused (zerodp forms the world from the environment)."""
    if torch.distributed.is_initialized():
        return  # as DeepSpeed: a group made already is the world
    launch = _launch_environment(auto_mpi_discovery, distributed_port)
    _check_given_world(launch, rank, world_size, init_method)
    if dist_backend is not None and launch.distributed:
        export_torch_variables(launch)
        torch.distributed.init_process_group(backend=_usable_backend(dist_backend))
        return
    _comm.init_distributed(launch=launch)


def _check_given_world(launch: LaunchEnvironment, rank: int, world_size: int, init_method) -> None:
    if init_method not in (None, "env://"):
        raise LaunchError(f"init_distributed(init_method={init_method!r}): zerodp forms the world from the launcher's "
                          f"environment only; launch with torchrun (or srun/mpirun) and drop init_method")
    given = [(name, value, mine) for name, value, mine in (("rank", rank, launch.rank),
                                                            ("world_size", world_size, launch.world_size))
             if value is not None and value >= 0 and value != mine]
    if given:
        said = ", ".join(f"{name}={value}" for name, value, _ in given)
        raise LaunchError(f"init_distributed({said}) but the launch environment says "
                          f"{', '.join(f'{name}={mine}' for name, _, mine in given)} ({launch.describe()}); drop the "
                          f"arguments (zerodp reads the environment) or launch with a matching world")


def _launch_environment(auto_mpi_discovery: bool, distributed_port: int) -> LaunchEnvironment:
    launch = read_launch_environment(default_port=distributed_port)
    if launch.from_scheduler and launch.distributed and not auto_mpi_discovery:
        raise LaunchError(f"init_distributed(auto_mpi_discovery=False) in a process {launch.describe()} started "
                          f"without torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): "
                          f"it would train alone; pass auto_mpi_discovery=True (the default) to form the world from "
                          f"the launcher's variables, or launch with torchrun")
    return launch


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags: --deepspeed, --deepspeed_config (and the old --deepscale ones)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by zerodp.deepspeed)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (kept for compatibility; zerodp is always on).")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ConfigError("initialize got both config and config_params (the same argument); pass one")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ConfigError(f"initialize got a config and args.deepspeed_config={from_args!r}; DeepSpeed refuses both "
                          f"too: pass one")
    source = config if config is not None else from_args
    if source is None:
        raise ConfigError("no DeepSpeed config: pass config=<dict or path>, or args with --deepspeed_config")
    if isinstance(source, str) and source.lstrip().startswith("{"):
        source = json.loads(source)  # DeepSpeed also accepts a JSON string
    return source


def _casts_inputs(source) -> bool:
    """DeepSpeed's engine casts floating inputs only under fp16 with `auto_cast: true`; never under bf16 or
    fp32 (an fp32 input added to a bf16 activation then promotes the result to fp32)."""
    raw = source
    if isinstance(source, (str, Path)):
        path = Path(source)
        raw = json.loads(path.read_text()) if path.suffix == ".json" else {}
    fp16 = raw.get("fp16", {}) if isinstance(raw, dict) else {}
    return bool(isinstance(fp16, dict) and fp16.get("enabled") is True and fp16.get("auto_cast") is True)


def initialize(args=None, model: Optional[nn.Module] = None, optimizer: Any = None, model_parameters=None,
               training_data=None, lr_scheduler: Any = None, config=None, config_params=None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               mpu=None, distributed_port=None, dist_init_timeout=None, **unsupported):
    """DeepSpeed's `initialize`: returns (engine, optimizer, training_dataloader, lr_scheduler).

    A translation of DeepSpeed's arguments (config from args, the config's optimizer over model_parameters,
    which inputs to cast); the engine itself is built by the one `zerodp.initialize`."""
    if unsupported:
        raise TypeError(f"zerodp.deepspeed.initialize does not take {sorted(unsupported)}")
    if model is None:
        raise ValueError("initialize needs model=<torch.nn.Module>")
    if dist_init_required is False and not torch.distributed.is_initialized() and read_launch_environment().distributed:
        # DeepSpeed refuses this too; zerodp.initialize would create the group the caller said not to create
        raise ConfigError("initialize(dist_init_required=False) under torchrun, but torch.distributed is not "
                          "initialized: call torch.distributed.init_process_group first, or leave dist_init_required "
                          "unset")
    if dist_init_required is not False:
        init_distributed()
    source = _config_source(args, config, config_params)
    cfg = load_config(source)
    if optimizer is None and cfg.optimizer is not None and model_parameters is not None:
        # DeepSpeed builds the config's optimizer over model_parameters (which may be param groups)
        if isinstance(cfg.optimizer, list) or cfg.optimizer.select is not None:
            # sections with 'select' choose among the model's trainable parameters by name and kind
            given = list(model_parameters)
            if {id(p) for p in given if isinstance(p, torch.Tensor)} != {id(p) for p in model.parameters()
                                                                        if p.requires_grad} or len(given) == 0:
                raise ConfigError("optimizer sections with 'select' choose among all the model's trainable "
                                  "parameters; pass model_parameters=model.parameters() (not param groups)")
            optimizer = build_from_sections(cfg.optimizer, model)
        else:
            optimizer = build_from_section(cfg.optimizer.type, cfg.optimizer.params, model_parameters)
        cfg = cfg.model_copy(update={"optimizer": None})
    if cfg.stage == 3:  # modules set as stage-3 leaves become units (utils/z3_leaf.py)
        units = leaf_unit_modules(model, cfg.zero_optimization.stage3_unit_modules)
        if units != cfg.zero_optimization.stage3_unit_modules:
            cfg = cfg.model_copy(update={"zero_optimization": cfg.zero_optimization.model_copy(
                update={"stage3_unit_modules": units})})
    if optimizer is None and cfg.optimizer is None:
        # nothing to train with: DeepSpeed's engine for forward passes (a frozen reference model)
        if lr_scheduler is not None or cfg.scheduler is not None or training_data is not None:
            raise ConfigError("initialize got a learning-rate schedule or training_data but no optimizer; pass "
                              "optimizer=... or an 'optimizer' config section, or drop them for a forward-only engine")
        if mpu is not None:
            raise ConfigError("initialize(mpu=...) without an optimizer: the forward-only engine shards over the whole "
                              "world, not a data-parallel group; pass an optimizer, or build the engine without mpu")
        return ForwardEngine(model, cfg), None, None, None
    engine = DeepSpeedEngine(zerodp_initialize(model, optimizer, cfg, cast_inputs=_casts_inputs(source),
                                               lr_scheduler=lr_scheduler, mpu=mpu), config=source,
                             client_optimizer=optimizer)
    loader = engine.deepspeed_io(training_data, collate_fn=collate_fn) if training_data is not None else None
    return engine, engine.optimizer, loader, engine.lr_scheduler
