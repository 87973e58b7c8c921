"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters` over zerodp's stage-3 equivalents."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ...config import ConfigError, load_config
from ...shard.stage3 import gathered_parameters, init_context


class _Switchable(contextlib.ContextDecorator):
    """DeepSpeed's `enabled=` contexts: enter zerodp's context made by `_open()`, or do nothing when disabled."""

    enabled: bool = True
    _ctx = None

    def _open(self):
        raise NotImplementedError

    def __enter__(self):
        if self.enabled:
            self._ctx = self._open()
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            return ctx.__exit__(*exc)
        return False


class Init(_Switchable):
    """Create parameters already partitioned (ZeRO stage 3): `with deepspeed.zero.Init(config_dict_or_path=cfg):`.

    zerodp needs the stage-3 config (for the persistence threshold and dtype); pass it as
    `config_dict_or_path` or `config`, as DeepSpeed recommends. `enabled=False` does nothing.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear: bool = True, remote_device=None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype=None, mpu=None, **unused) -> None:
        if module is not None:
            raise ConfigError("zero.Init(module=...) partitions an existing model in DeepSpeed; zerodp partitions "
                              "it in zerodp.deepspeed.initialize instead: create the model normally")
        self.enabled = enabled
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        if enabled and self.config is None:
            raise ConfigError("zero.Init needs the stage-3 config: zero.Init(config_dict_or_path=ds_config)")
        if enabled and remote_device not in (None, "none"):
            # zerodp takes where parameters live from the config's offload_param (init_context reads it there)
            configured = load_config(self.config).zero_optimization.offload_param.device.value
            if configured != remote_device:
                raise ConfigError(f"zero.Init(remote_device={remote_device!r}) but the config's "
                                  f"zero_optimization.offload_param.device is {configured!r}; set offload_param "
                                  f"to {{\"device\": \"{remote_device}\", ...}} in the config (zerodp reads it there)")
            self.config = load_config(self.config)
        # with Megatron's mpu, stage 3 shards over its data-parallel group (as zerodp.deepspeed.initialize(mpu=) does)
        self.group = data_parallel_group if data_parallel_group is not None or mpu is None \
            else mpu.get_data_parallel_group()
        self._ctx = None

    def _open(self):
        return init_context(self.config, self.group)


class GatheredParameters(_Switchable):
    """Gather partitioned parameters for the block; writes on `modifier_rank` reach every rank after it.

    `None` entries are skipped, as DeepSpeed skips them (transformers passes `[head.weight, head.bias]` for
    a head without a bias)."""

    def __init__(self, params, modifier_rank: Optional[int] = None, fwd_module=None, enabled: bool = True) -> None:
        if params is not None and not isinstance(params, torch.Tensor):
            params = [p for p in params if p is not None]
        self.params, self.modifier_rank, self.enabled = params, modifier_rank, enabled
        self._ctx = None

    def _open(self):
        return gathered_parameters(self.params, modifier_rank=self.modifier_rank)
