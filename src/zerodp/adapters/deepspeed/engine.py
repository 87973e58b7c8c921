"""`DeepSpeedEngine`: DeepSpeed's engine methods over a `ZeroEngine`.

Differences from DeepSpeed, on purpose, all in one place:
  - every stage is exact (equal to plain PyTorch on the global batch); there are no fused kernels;
  - `load_checkpoint` loads at any world size or stage (DeepSpeed needs universal checkpoints), zerodp's checkpoints
    and DeepSpeed's own (ZeRO stages 1-3 and universal folders: checkpoint/deepspeed_reader.py);
  - `save_checkpoint` writes zerodp's format and, beside it, DeepSpeed's layout (docs/checkpoints.md);
  - `save_16bit_model` works at every stage, also without `stage3_gather_16bit_weights_on_model_save`
    (DeepSpeed saves nothing at stage 3 without it); a `.safetensors` name writes safetensors, any
    other name `torch.save`s the state dict, as DeepSpeed does;
  - `load_optimizer_states=False` and `load_module_only=True` are refused (not implemented);
  - `offload_states(device=cpu)` / `reload_states()`: on a CPU run every state already lives in CPU memory,
    so both move nothing and free nothing (DeepSpeed 0.19.8 with DS_ACCELERATOR=cpu frees nothing either:
    its process RSS does not drop); states on a GPU are refused (moving them is not implemented; the config's
    offload_optimizer / offload_param keep them in CPU memory for the whole run instead);
  - `destroy()` is zerodp's `close()`: hooks and buffers are released, and so is the process group if
    zerodp created it (DeepSpeed keeps the group), so call it last.
"""

from __future__ import annotations

import shutil
import weakref
from pathlib import Path
from typing import Any, Optional

import torch

from ...config import ConfigError
from ...engine.zero_engine import ZeroEngine
from ...optimizers.client_schedule import ClientSchedule  # noqa: F401 (zerodp.deepspeed.engine.ClientSchedule, as before)
from .consolidated_weights import ConsolidatedWeights
from .checkpoint_files import write_deepspeed_files
from ...checkpoint import deepspeed_zero_to_fp32
from ...checkpoint.deepspeed_writer import write_deepspeed_layout
from ...checkpoint.tensor_parallel import rank_dir
from ...tensor_parallel.mpu import mpu_call
from .utils.timer import ThroughputTimer
from .zero_optimizer import ZeroOptimizer

# Which engine trains a parameter (for zerodp.deepspeed.utils' per-parameter getters).
ZERO_TO_FP32_SCRIPT = deepspeed_zero_to_fp32.__file__  # copied beside `latest`, as DeepSpeed copies its own
ENGINE_OF_PARAM: "weakref.WeakValueDictionary[int, DeepSpeedEngine]" = weakref.WeakValueDictionary()


class DeepSpeedEngine(ConsolidatedWeights):
    """What DeepSpeed training scripts call on the engine `deepspeed.initialize` returns."""

    def __init__(self, engine: ZeroEngine, config: Any = None, client_optimizer: Any = None) -> None:
        self.engine = engine
        self._ds_config = config  # the config as initialize got it (DeepSpeed's engine.config)
        # the optimizer the caller passed to initialize (None: built from the config): a load restores its groups
        self._client_optimizer = client_optimizer if isinstance(client_optimizer, torch.optim.Optimizer) else None
        for p in engine.module.parameters():
            ENGINE_OF_PARAM[id(p)] = self
        self.tput_timer = ThroughputTimer(engine.train_batch_size)
        self._zero_optimizer = ZeroOptimizer(engine)

    # -- the training loop ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.engine.module.training:  # DeepSpeed times training steps only
            self.tput_timer.start()
        return self.engine(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """DeepSpeed's backward: `scale_wrt_gas=False` when the caller divided the loss by the accumulation steps
        itself (the HF Trainer); returns the loss as divided for the gradients (DeepSpeed's return value)."""
        self.engine.backward(loss, divide_by_accumulation_steps=scale_wrt_gas, retain_graph=retain_graph)
        return loss / self.engine.gradient_accumulation_steps if scale_wrt_gas else loss

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say before each backward whether it ends an accumulation (Accelerate does, then calls step() once)."""
        self.engine.set_accumulation_boundary(is_boundary)

    def step(self, lr_kwargs=None) -> None:
        boundary = self.engine.is_accumulation_boundary  # read before step() advances the micro-step count
        self.engine.step()
        self.tput_timer.stop(global_step=boundary)

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.engine.train(mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def zero_grad(self) -> None:
        """Gradients are zeroed by step() at each boundary; nothing to do (as with DeepSpeed's engine)."""

    def compile(self, backend: str = "inductor", compile_kwargs: Optional[dict] = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """`torch.compile` the model in place (`module.compile(backend=..., **compile_kwargs)`), as DeepSpeed's
        engine does without DeepCompile; zerodp's stage-3 gathers stay eager hooks around the compiled code.
        A second call is a no-op. DeepCompile's `schedule` and compiled autograd are refused."""
        if schedule is not None or compiled_autograd_enabled:
            raise ConfigError("engine.compile(schedule=..., compiled_autograd_enabled=True) belongs to DeepSpeed's "
                              "DeepCompile, which zerodp does not implement; call engine.compile() without them")
        if self.__dict__.get("_is_compiled", False):
            return
        self.engine.compile(**{**(compile_kwargs or {}), "backend": backend})
        self.__dict__["_is_compiled"] = True

    @property
    def is_compiled(self) -> bool:
        return self.__dict__.get("_is_compiled", False)

    # -- attributes and figures ----------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> ZeroOptimizer:
        return self._zero_optimizer

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler) -> None:
        """As in DeepSpeed, the engine steps what is set here after each optimizer step; Lightning sets None and
        steps the schedule itself (`lr_scheduler` returned it before)."""
        self.engine.lr_scheduler = scheduler

    @property
    def config(self):
        """The config as `initialize` got it (a dict, or the path), as DeepSpeed's engine keeps it: transformers reads
        `engine.config.get("zero_optimization")`. zerodp's validated config is `engine.zero_config`."""
        return self._ds_config if self._ds_config is not None else self.engine.config

    @property
    def zero_config(self):
        return self.engine.config

    @property
    def global_rank(self) -> int:
        # with an mpu the engine's rank is its data-parallel rank; DeepSpeed's global_rank is the world's
        return self.engine.rank if self.engine.mpu is None else torch.distributed.get_rank()

    @property
    def local_rank(self) -> int:
        from ...comm.launch_env import local_rank

        return local_rank()

    @property
    def world_size(self) -> int:
        return self.engine.world_size if self.engine.mpu is None else torch.distributed.get_world_size()

    @property
    def dp_world_size(self) -> int:
        return self.engine.world_size

    @property
    def mp_world_size(self) -> int:
        return 1 if self.engine.mpu is None else mpu_call(self.engine.mpu, "get_model_parallel_world_size")

    @property
    def device(self) -> torch.device:
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def global_steps(self) -> int:
        return self.engine.global_step

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_step

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def train_batch_size(self) -> int:
        return self.engine.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_accumulation_boundary

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def get_global_grad_norm(self) -> Optional[float]:
        return self.engine.grad_norm

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self.engine.stage

    def zero_optimization(self) -> bool:
        return self.engine.stage > 0

    def __getattr__(self, name: str):
        # anything else zerodp's engine has (memory_report, full_state_dict, timings, ...), then, as DeepSpeed's
        # engine does, the model's own attributes (`engine.config` of an HF model is the engine's, but
        # `engine.model`, `engine.gradient_checkpointing_enable` are the module's)
        engine = self.__dict__["engine"]
        try:
            return getattr(engine, name)
        except AttributeError:
            pass
        try:
            return getattr(engine.module, name)
        except AttributeError:
            raise AttributeError(f"'DeepSpeedEngine' object has no attribute {name!r} (neither has its module, "
                                 f"{type(engine.module).__name__})") from None

    # -- states between devices ------------------------------------------------------------------------
    def _state_devices(self) -> set:
        """The devices holding the model's parameters and buffers and the optimizer's state."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        inner = getattr(self.optimizer, "optimizer", None)
        for state in (getattr(inner, "state", None) or {}).values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return {t.device.type for t in tensors}

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """DeepSpeed's `offload_states`: move the engine's states (`include`: OffloadStateTypeEnum members, all if
        None) to CPU memory until `reload_states()`. zerodp runs them where they already are: on a CPU run
        this moves nothing (see the module docstring); GPU-resident states are refused."""
        from .runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        for state in include or ():
            OffloadStateTypeEnum(state)  # DeepSpeed's names only: a typo fails here, naming the value
        target = OffloadDeviceEnum(device)
        if target is OffloadDeviceEnum.nvme:
            raise ValueError("offload_states(device=nvme): NVMe is not supported for offloading states (as in "
                             "DeepSpeed); pass OffloadDeviceEnum.cpu")
        on_device = self._state_devices() - {"cpu"}
        if target is OffloadDeviceEnum.cpu and on_device:
            raise NotImplementedError(f"engine.offload_states: moving states from {sorted(on_device)} to CPU memory "
                                      f"between steps is not implemented in zerodp; keep them in CPU memory for the "
                                      f"whole run with zero_optimization.offload_optimizer / offload_param")

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring offloaded states back to the training device: on a CPU run they never left (nothing to do);
        GPU-resident states could not have been offloaded (offload_states refuses them)."""

    def destroy(self) -> None:
        """DeepSpeed's end-of-run release: zerodp's `close()` (see the module docstring)."""
        self.engine.close()

    # -- data ------------------------------------------------------------------------------------------
    def deepspeed_io(self, dataset, batch_size: Optional[int] = None, route=None, pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers=None):
        """A DataLoader of micro-batches: each rank reads its own part of `dataset` (DistributedSampler)."""
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = data_sampler or DistributedSampler(dataset, num_replicas=self.dp_world_size, rank=self.engine.rank)
        return DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(), sampler=sampler,
                          collate_fn=collate_fn, drop_last=self.engine.config.dataloader_drop_last,
                          pin_memory=pin_memory and torch.cuda.is_available(), num_workers=num_local_io_workers or 0)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        checkpoint_format: str = "zerodp+deepspeed") -> bool:
        """Every rank calls it; writes save_dir/tag and returns True. `checkpoint_format`:
          - "zerodp+deepspeed" (the default, at stages 1-3): zerodp's sharded format (what zerodp resumes, at any world
            size or stage) and, beside it in the same folder, DeepSpeed's ZeRO layout (checkpoint/deepspeed_writer.py)
            with a zero_to_fp32.py beside `latest`, so DeepSpeed's tools and DeepSpeed itself read it;
          - "zerodp": zerodp's format and DeepSpeed-named index files only (checkpoint_files.py; half the disk).
        Stage 0 and tensor parallelism always write the latter. With stage3_gather_16bit_weights_on_model_save, the
        16-bit weights go next to it too."""
        if not save_latest:
            raise ConfigError("save_checkpoint(save_latest=False) is not supported: zerodp's commit point is the "
                              "'latest' file; remove the argument")
        if checkpoint_format not in ("zerodp+deepspeed", "zerodp"):
            raise ConfigError(f"save_checkpoint(checkpoint_format={checkpoint_format!r}): use 'zerodp+deepspeed' (the "
                              f"default: DeepSpeed's tools read it too) or 'zerodp'")
        client_state = dict(client_state or {})
        path = self.engine.save_checkpoint(save_dir, tag=None if tag is None else str(tag), client_state=client_state)
        if checkpoint_format == "zerodp+deepspeed" and self.engine.stage >= 1 and self.engine.mpu is None:
            write_deepspeed_layout(self.engine, path, client_state,
                                   self._ds_config if isinstance(self._ds_config, dict) else None)
            if self.global_rank == 0:
                shutil.copyfile(ZERO_TO_FP32_SCRIPT, Path(save_dir) / "zero_to_fp32.py")
        elif self.global_rank == 0:
            write_deepspeed_files(path, self.engine.stage, self.world_size, self.engine.global_step,
                                  self.engine.skipped_steps, client_state)
        if self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            self.save_16bit_model(path, "model.safetensors")
        return True

    def load_checkpoint(self, load_dir, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Resume from save_dir (the 'latest' tag unless `tag`); returns (path, client_state)."""
        if not load_optimizer_states or load_module_only or not load_module_strict or custom_load_fn is not None:
            raise ConfigError("load_checkpoint: loading only the module (load_optimizer_states=False, "
                              "load_module_only=True, load_module_strict=False, custom_load_fn) is not implemented; "
                              "load the weights with zerodp.consolidate_checkpoint(path) and model.load_state_dict")
        from ...checkpoint.save_load import checkpoint_tag_dir

        if self.engine.mpu is not None:  # this tensor-parallel rank's directory (checkpoint/tensor_parallel.py)
            load_dir = rank_dir(self.engine.mpu, load_dir, saved=True)

        path = checkpoint_tag_dir(load_dir, None if tag is None else str(tag))
        client_state = self.engine.load_checkpoint(load_dir, tag=None if tag is None else str(tag),
                                                   load_lr_scheduler=load_lr_scheduler_states)
        self._restore_client_groups()
        return str(path), client_state

    def _restore_client_groups(self) -> None:
        """Copy the loaded group hyper-parameters (lr, betas, ...) into the caller's optimizer: DeepSpeed loads into
        the very optimizer it was given, and a schedule built on it (Lightning steps it itself, after restoring
        only its counters) reads the group's lr at its next step."""
        if self._client_optimizer is None:
            return
        sharded = self.engine.optimizer
        for group, user_index in zip(sharded.param_groups, sharded.group_indices):
            target = self._client_optimizer.param_groups[user_index]
            if target is not group:
                target.update({k: v for k, v in group.items() if k != "params"})

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the whole model's weights in the compute dtype (rank 0); every rank must call it."""
        state = self.engine.full_state_dict(rank0_only=True)
        if self.engine.mpu is not None and not _inside_tp_dir(save_dir):
            save_dir = rank_dir(self.engine.mpu, save_dir)  # each tensor-parallel rank writes its own shards
        if self.engine.rank == 0:
            dtype = {True: torch.float16}.get(self.fp16_enabled(), torch.bfloat16 if self.bfloat16_enabled()
                                              else torch.float32)
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            out = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().clone() for k, v in state.items()
                   if not (exclude_frozen_parameters and k in frozen)}
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".safetensors":
                from safetensors.torch import save_file

                save_file(out, str(path), metadata={"format": "pt"})
            else:
                torch.save(out, path)
        from .comm import barrier

        barrier(self.engine.process_group)
        return True


def _inside_tp_dir(path) -> bool:
    """True for a path inside a tensor-parallel rank's checkpoint directory (save_checkpoint's tag path)."""
    return any(part.startswith("tp-") and "-of-" in part for part in Path(path).parts)
