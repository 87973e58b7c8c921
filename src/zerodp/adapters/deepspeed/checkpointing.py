"""DeepSpeed's `deepspeed.checkpointing` (runtime/activation_checkpointing/checkpointing.py): the same
names and meanings, over zerodp.activations.

What scripts call:
    Megatron-DeepSpeed, gpt-neox   configure(mpu, deepspeed_config=args.deepspeed_config,
                                             num_checkpoints=args.num_layers, ...)
                                   checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed,
                                   is_configured, reset
    Lightning, Accelerate          configure(mpu_=None, partition_activations=..., contiguous_checkpointing=...,
                                             checkpoint_in_cpu=..., profile=...)  (None: not set)

`configure` starts from DeepSpeed's defaults, reads `deepspeed_config`'s `activation_checkpointing`
section (a dict or a JSON/YAML path) if given, then applies every argument that is not None. An mpu
given once is kept by later calls with `mpu_=None`, as in DeepSpeed.

Where this differs from DeepSpeed on purpose (docs/activations.md):
  - partition_activations without an mpu is an error (DeepSpeed keeps the inputs whole, silently);
  - checkpoint_in_cpu works with or without partition_activations (DeepSpeed's docstring says it needs
    partitioning; its code no longer does);
  - contiguous_checkpointing works without partition_activations and without num_checkpoints
    (DeepSpeed asserts on both); unset, the buffers are sized by the first forward;
  - `num_checkpoints` without contiguous buffers is accepted and unused (Megatron passes it on every run);
    in a config file, `number_checkpoints` without `contiguous_memory_optimization` is an error;
  - partitioning pads instead of asserting when an input's size is not a multiple of TP;
  - the RNG tracker works on a CPU-only machine (it forks the CPU generator there).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from ...activations import PROCESS, RNGStatesTracker, seed_model_parallel
from ...activations.process_checkpointer import checkpoint, non_reentrant_checkpoint
from ...tensor_parallel.random import MODEL_PARALLEL_SEED_OFFSET, manual_seed
from ...config.activation_checkpointing import ActivationCheckpointingConfig
from ...errors import ConfigError

CudaRNGStatesTracker = RNGStatesTracker  # DeepSpeed's name (it tracks CPU states on a CPU-only machine)
log = logging.getLogger("zerodp.deepspeed")

__all__ = ["configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint", "get_cuda_rng_tracker",
           "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "CudaRNGStatesTracker",
           "partition_activations_in_checkpoint", "set_num_layers"]


def _section(deepspeed_config: Any) -> dict:
    """The `activation_checkpointing` mapping of a DeepSpeed config (dict, JSON/YAML path, or ZeroConfig)."""
    if hasattr(deepspeed_config, "activation_checkpointing"):
        return deepspeed_config.activation_checkpointing.model_dump(exclude_unset=True)
    if isinstance(deepspeed_config, (str, Path)):
        path = Path(deepspeed_config)
        if not path.is_file():
            raise ConfigError(f"deepspeed_config {str(path)!r} is not a file")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    elif isinstance(deepspeed_config, dict):
        data = deepspeed_config
    else:
        raise ConfigError(f"deepspeed_config must be a dict or a path, not {type(deepspeed_config).__name__}")
    section = (data or {}).get("activation_checkpointing") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"activation_checkpointing must be a mapping of keys, got {type(section).__name__}")
    return section


def configure(mpu_: Optional[Any], deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Configure activation checkpointing (DeepSpeed's signature; arguments override the config file)."""
    values = dict(_section(deepspeed_config)) if deepspeed_config is not None else {}
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    if num_checkpoints is not None and not (contiguous_checkpointing if contiguous_checkpointing is not None
                                            else values.get("contiguous_memory_optimization", False)):
        # Megatron-DeepSpeed passes num_checkpoints=num_layers on every run; only contiguous buffers use it.
        log.info("activation checkpointing: num_checkpoints=%s is used only by contiguous_checkpointing, which is "
                 "off", num_checkpoints)
        overrides["number_checkpoints"] = None
    values.update({key: value for key, value in overrides.items() if value is not None})
    settings = _settings(values)
    checkpointer = PROCESS.configure(settings, mpu_)
    log.info("activation checkpointing: partition_activations=%s cpu_checkpointing=%s contiguous=%s "
             "(number_checkpoints=%s) synchronize=%s profile=%s, model-parallel size %d",
             settings.partition_activations, settings.cpu_checkpointing, settings.contiguous_memory_optimization,
             settings.number_checkpoints, settings.synchronize_checkpoint_boundary, settings.profile,
             checkpointer.group.world_size)


def is_configured() -> bool:
    """True once `configure` has been called (or zerodp.initialize had an activation_checkpointing section)."""
    return PROCESS.checkpointer is not None


def reset() -> None:
    """Free the contiguous buffers: call it after forwards that had no backward (evaluation with grad on)."""
    if PROCESS.checkpointer is not None:
        PROCESS.checkpointer.reset()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's RNG tracker (`fork()` inside tensor-parallel regions)."""
    return PROCESS.tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: default generator `seed`, tracker state `seed + 2718 + tp_rank` (tp_rank of the mpu)."""
    data_seed, model_seed = seed_model_parallel(PROCESS.tracker, seed, PROCESS.tp_rank())
    log.info("model-parallel seeds: data-parallel %d, model-parallel %d", data_seed, model_seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed the tracker's model-parallel state (DeepSpeed's name), leaving the default generator alone."""
    tracker = PROCESS.tracker
    with tracker.fork():
        manual_seed(tracker.device_type, seed + MODEL_PARALLEL_SEED_OFFSET + PROCESS.tp_rank())


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Switch partition_activations on or off, keeping the other settings."""
    _update(partition_activations=bool(partition_activation))


def set_num_layers(nlayers: int) -> None:
    """Set number_checkpoints (the contiguous buffers' slot count), keeping the other settings; an error
    when contiguous buffers are off (the count would have no effect)."""
    _update(number_checkpoints=int(nlayers))


def _update(**changes: Any) -> None:
    current = PROCESS.checkpointer.settings if PROCESS.checkpointer is not None else ActivationCheckpointingConfig()
    PROCESS.configure(_settings({**current.model_dump(), **changes}))


def _settings(values: dict) -> ActivationCheckpointingConfig:
    try:
        return ActivationCheckpointingConfig(**values)
    except Exception as err:  # pydantic's ValidationError: one message naming the key
        raise ConfigError(f"activation_checkpointing: {err}") from None
