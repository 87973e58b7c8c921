"""DeepSpeed's training API over zerodp: a DeepSpeed script switches by changing one import line,

    import zerodp.deepspeed as deepspeed        # was: import deepspeed

and keeps `deepspeed.initialize(args=..., model=..., model_parameters=..., config=...)`,
`engine.backward(loss)`, `engine.step()`, `engine.save_checkpoint(dir, client_state=...)`,
`engine.load_checkpoint(dir)`, `deepspeed.zero.Init`, `deepspeed.comm.get_rank()`, ...

This package is a thin adapter: the engine, the config (DeepSpeed's keys, `config.compat`), the
optimizers (`optim.deepspeed_types`) and the schedules (`optim.lr_schedules`) are zerodp's own.
Where zerodp differs from DeepSpeed on purpose (see `DeepSpeedEngine`), it is exact: every stage
equals plain single-process PyTorch on the global batch.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import comm as _comm
from ..config import ConfigError, load_config
from ..engine import ZeroEngine
from ..optim.build import build_from_section, build_from_sections
from . import accelerator, comm, moe, ops, runtime, utils, zero
from .accelerator import get_accelerator
from .engine import DeepSpeedEngine

__all__ = ["initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine", "get_accelerator",
           "accelerator", "comm", "moe", "ops", "runtime", "utils", "zero"]


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout=None, init_method=None,
                     dist_init_required=None, config=None, rank: int = -1, world_size: int = -1) -> None:
    """Initialize torch.distributed from torchrun's environment (gloo on CPU, NCCL on GPU) if not done yet."""
    if dist_backend is not None and not torch.distributed.is_initialized() and "RANK" in __import__("os").environ:
        torch.distributed.init_process_group(backend=dist_backend)
        return
    _comm.init_distributed()


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


def initialize(args=None, model: Optional[nn.Module] = None, optimizer: Any = None, model_parameters=None,
               training_data=None, lr_scheduler: Any = None, config=None, config_params=None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               mpu=None, distributed_port=None, dist_init_timeout=None, **unsupported):
    """DeepSpeed's `initialize`: returns (engine, optimizer, training_dataloader, lr_scheduler)."""
    if unsupported:
        raise TypeError(f"zerodp.deepspeed.initialize does not take {sorted(unsupported)}")
    if model is None:
        raise ValueError("initialize needs model=<torch.nn.Module>")
    if mpu is not None:
        raise ConfigError("mpu (model parallelism) is not supported by zerodp; zerodp is data parallel only")
    if dist_init_required is not False:
        init_distributed()
    cfg = load_config(_config_source(args, config, config_params))
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
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("a lr_scheduler was passed and the config has a 'scheduler' section; keep one")
    engine = DeepSpeedEngine(ZeroEngine(model, optimizer, cfg), lr_scheduler=lr_scheduler)
    loader = engine.deepspeed_io(training_data, collate_fn=collate_fn) if training_data is not None else None
    return engine, engine.optimizer, loader, engine.lr_scheduler
