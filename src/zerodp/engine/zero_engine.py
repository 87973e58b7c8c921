"""The engine: forward, backward, step and accumulation over one model, for every ZeRO stage.

Stages are policies over this one engine, not copies of it: stages 0-2 lay trainable parameters out
in gradient buckets (`stage12/`), stage 3 in gathered units (`stage3/`), as `sharding.build_sharding`
chooses once for the configured stage. The engine drives either
strategy through `seams.ShardingStrategy` and steps its units (`seams.ShardedUnit`) with one
`ShardedOptimizer`; it is the only caller of both (see seams.py for one step's calls in order).

Scale factors, in one place: backward multiplies the micro-batch mean loss by
    loss_scale / gradient_accumulation_steps
so that, after gradients are summed over micro-steps and averaged over ranks (buckets divide by N),
the update equals one step on the global batch; the loss scale is divided out before clipping.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Optional

import torch
from torch import nn

from .. import comm
from ..checkpoint import full_state_dict, read_checkpoint, save_checkpoint
from ..checkpoint.deepspeed_writer import write_deepspeed_layout
from ..checkpoint.dcp import read_dcp, save_dcp
from ..checkpoint.state import set_rng_state
from ..checkpoint.tensor_parallel import rank_dir as tp_rank_dir, save_per_rank as tp_save
from ..config import ConfigError, ZeroConfig, load_config
from ..config.auto import resolve_auto
from ..errors import CheckpointError, NonFiniteError
from ..optimizers.client_schedule import build_schedule, engine_schedule
from ..optimizers.lr_schedules import build_lr_scheduler
from ..monitor.memory_report import MemoryReport, measure_memory
from ..host_memory import TRIM_INTERVAL_STEPS, release_free_memory
from ..comm.module_device import place_module
from ..monitor.monitor import Monitor
from .nonfinite import NonFinitePolicy, check_hyperparameters, describe
from .grad_path import compose_grad_staging
from .optimizer_offload import build_optimizer_offload
from ..optim.inner import group_hyperparameters
from ..optim.model_parallel import data_parallel_group, model_parallel_norm
from ..optim.optimizer import ShardedOptimizer, StepOutcome
from ..offload.placement import model_device, placement_of
from ..precision.policy import LossScaler, PrecisionPolicy, cast_floats
from .preflight import check_same_model
from .runtime import RUNTIME, Lease
from .step_log import log_step
from .sharding import build_sharding

log = logging.getLogger("zerodp")


def _under_lease(method):
    """Run an engine call under this engine's settings for comm (comm_timeout_s, debug_sync, real collectives,
    activity: runtime.py), then those from before: `Lease.in_force()`'s two writes, inline (no call out per step)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        state = self._lease.runtime.comm
        outer, state.engine = state.engine, self._lease.comm
        try:
            return method(self, *args, **kwargs)
        finally:
            state.engine = outer
    return call


class ZeroEngine:
    """A model trained with ZeRO. Create it with `zerodp.initialize`."""

    def __init__(self, model: nn.Module, optimizer: Any, config: ZeroConfig,
                 process_group: comm.ProcessGroup = None, cast_inputs: bool = True, *, lr_scheduler: Any = None,
                 lease: Optional[Lease] = None, mpu: Any = None) -> None:
        if lr_scheduler is not None and config.scheduler is not None:
            raise ConfigError("a lr_scheduler was passed and the config has a 'scheduler' section; keep one")
        self.module = model
        self.config = config
        self.mpu = mpu  # Megatron's: ZeRO shards over its data-parallel group; norms and overflow span both groups
        self.process_group = process_group = data_parallel_group(mpu, process_group)
        self.rank = comm.get_rank(process_group)
        self.world_size = comm.get_world_size(process_group)
        # process-wide settings (watchdog, real collectives, default group, allocator): runtime.py; close() gives back
        self._lease = lease if lease is not None else RUNTIME.lease(config, self.rank, process_group)
        self._lease.held_by(self)
        self._activity = self._lease.comm.activity  # what this engine is doing, for the watchdog's reports
        self._activity.enter("setup")
        check_same_model(model, process_group)
        config = self.config = resolve_auto(config, model)  # DeepSpeed's "auto" values (config/auto.py)
        self.stage = config.stage
        self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps = \
            config.resolve_batch(self.world_size)
        self.precision = PrecisionPolicy.from_config(config)
        # forward() casts floating inputs to the compute dtype under bf16/fp16; zerodp.deepspeed turns this
        # off where DeepSpeed does not cast (bf16, fp16 without auto_cast): an fp32 input then stays fp32
        self.cast_inputs = cast_inputs
        self.scaler = LossScaler.from_config(config)
        self.global_step = 0
        self.micro_step = 0
        self.skipped_steps = 0
        self.nonfinite_steps = 0  # steps skipped for a NaN/Inf gradient under `nonfinite: skip`
        self._loss_finite: Optional[torch.Tensor] = None  # this rank's losses since the step, read only on error
        self._backward_since_step = False
        self._boundary_override: Optional[bool] = None  # set_accumulation_boundary
        self._last_step_time = time.perf_counter()
        # Seconds spent in forward / backward / step since the last log (wall_clock_breakdown).
        self.timings = {"forward": 0.0, "backward": 0.0, "step": 0.0}

        # Every name of every parameter: tied weights have several (e.g. wte.weight and lm_head.weight).
        self.param_names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(p), []).append(name)
        # the user's param groups by parameter name, frozen parameters included, read before zerodp rebuilds the
        # optimizer: a DCP export lists them as torch's get_state_dict does (checkpoint/dcp.py); None: no torch
        # optimizer was passed (the config builds one)
        self.param_group_names: Optional[list[list[str]]] = None if not hasattr(optimizer, "param_groups") else \
            [[self.param_names[id(p)][0] for p in g["params"] if id(p) in self.param_names]
             for g in optimizer.param_groups]
        # where each state lives (masters, optimizer state, staging buffers), decided once: placement.py
        self.placement = placement_of(config, model_device(model))
        # the optimizer resolved and checked, the model made the same on every rank and cast, its parameters laid
        # out by the configured stage's strategy (sharding.py)
        user_opt, self.autocast, self.sharding, expert_norm = build_sharding(
            model, optimizer, config, process_group, self.precision, self.world_size, self.placement)
        self.expert_parallel = expert_norm is not None  # MoE layers with experts split over ranks (moe/)
        if expert_norm is not None and mpu is not None:
            raise ConfigError("expert-parallel MoE layers beside tensor parallelism (mpu=) are not implemented; "
                              "train the MoE model without mpu")
        self.user_optimizer = user_opt  # read for its classes only (memory_report); never stepped
        self.units = self.sharding.units  # each holds its own shards' residency (seams.ShardedUnit.resident)
        offload = build_optimizer_offload(config, self.units, user_opt, process_group, self.placement)  # or None
        # the gradient shards' destination, chosen once from the placement (grad_path.py): None, or ZeRO-Offload's
        # host staging, armed before each backward and read by the optimizer's step
        self.grad_staging = compose_grad_staging(self.units, self.placement)
        self.optimizer = ShardedOptimizer(
            # norms and overflow checks over the ranks the shards split over (a MiCS block's replicas are copies)
            self.units, user_opt, group_hyperparameters(user_opt), self.precision, self.scaler, self.sharding.state_group,
            sharded=self.stage >= 1, gradient_clipping=config.gradient_clipping, offload=offload,
            placement=self.placement, model_parallel=expert_norm or model_parallel_norm(mpu, model),
            grad_staging=self.grad_staging)
        self.optimizer.late_starters.param_names = self.param_names  # to name them (optim/late_starters.py)
        # DeepSpeed's `scheduler` section or the caller's own schedule, stepped after every optimizer step taken
        self._lr_scheduler = None if config.scheduler is None else \
            build_lr_scheduler(config.scheduler.type, config.scheduler.params, self.optimizer.optimizer)
        if lr_scheduler is not None:  # the caller's own (optim/client_schedule.py)
            self._lr_scheduler = build_schedule(lr_scheduler, self)
        # DeepSpeed's monitoring sections (csv_monitor, tensorboard, wandb, comms_logger, flops_profiler)
        self.monitor = Monitor.from_config(config, self.rank, self.world_size, self.train_batch_size)
        if self.rank == 0:
            for note in config._notes:  # keys that change nothing here, said once with the reason
                log.info("zerodp config: %s", note)
            for warning in config._warnings:  # DeepSpeed's leniencies: what the key is read as, or that it is ignored
                log.warning("zerodp config: %s", warning)

    # -- the training loop -----------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @_under_lease
    def forward(self, *args, **kwargs):
        """Run the user's model; floating inputs are cast to the compute dtype under bf16/fp16."""
        if self.precision.mixed and self.cast_inputs:
            args, kwargs = cast_floats((args, kwargs), self.precision.param_dtype)
        self._activity.enter("forward")
        self.monitor.before_forward(self.global_step)
        with self._timed("forward"), \
                contextlib.nullcontext() if self.autocast is None else self.autocast.forward(self.module):
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def _timed(self, phase: str):
        if not self.config.wall_clock_breakdown:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # note: a sync point, only when timings were asked for
            self.timings[phase] += time.perf_counter() - start

    @property
    def is_accumulation_boundary(self) -> bool:
        """True when the next `step()` runs the optimizer (or what `set_accumulation_boundary` said last)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_step + 1) % self.gradient_accumulation_steps == 0

    def set_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Whether the next backwards end an accumulation (DeepSpeed's meaning; None: count micro-steps)."""
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    @_under_lease
    def backward(self, loss: torch.Tensor, divide_by_accumulation_steps: bool = True,
                 retain_graph: bool = False) -> None:
        """Backpropagate the micro-batch mean `loss`, loss-scaled, divided by the accumulation steps if asked."""
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}")
        boundary = self.is_accumulation_boundary
        self.sharding.start_micro_step(reduce=boundary or self.sharding.reduces_every_micro_step)
        if self.grad_staging is not None:  # ZeRO-Offload: copy the step's gradients to the host as they are reduced
            self.grad_staging.arm(boundary)
        scale = self.scaler.scale / (self.gradient_accumulation_steps if divide_by_accumulation_steps else 1)
        # A tensor, not a Python bool: reading it would be a device sync every micro-step.
        finite = torch.isfinite(loss.detach())
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        if self.monitor.writers or self.monitor.flops_profiler is not None:  # nothing to tell an idle monitor
            self.monitor.on_backward(loss)
        self._activity.enter("backward")
        with self._timed("backward"):
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            self._activity.enter("reduce")
            self._received = self.sharding.finish_micro_step(boundary)
        self._backward_since_step = True

    @_under_lease
    def step(self) -> None:
        """Call after every backward: at an accumulation boundary, step the optimizer and zero grads."""
        if not self._backward_since_step:
            raise RuntimeError("engine.step() called without engine.backward(loss) since the last step")
        boundary = self.is_accumulation_boundary
        self.micro_step += 1
        if boundary and self._boundary_override is not None:  # count whole accumulations (at_step_boundary)
            self.micro_step = -(-self.micro_step // self.gradient_accumulation_steps) * self.gradient_accumulation_steps
        self._backward_since_step = False
        self._activity.micro_step = self.micro_step
        if not boundary:
            return
        self._activity.enter("optimizer step")
        check_hyperparameters(self.optimizer.param_groups)  # a schedule may have produced a NaN lr
        with self._timed("step"):
            self.sync_written_shards()
            outcome = self.optimizer.step(self._received)
            if outcome is StepOutcome.NONFINITE:
                self._on_nonfinite()  # raises under `nonfinite: stop`, before the gradients are dropped
            if outcome is StepOutcome.STEPPED:
                self._activity.enter("after-step gather")
                self.sharding.after_step()  # re-assemble full parameters from the updated shards
            for unit in self.units:
                unit.zero_grad()
        self.sharding.end_step()  # stage 3 offload: this step's shard order predicts the next (read-ahead)
        self._loss_finite = None
        self.skipped_steps += 0 if outcome is StepOutcome.STEPPED else 1
        self.global_step += 1
        if self.stage == 3 and self.global_step % TRIM_INTERVAL_STEPS == 0:
            release_free_memory()  # stage 3's gather/free churn leaves holes malloc keeps: [Note: heap trimming] in host_memory.py
        self._activity.global_step = self.global_step
        if outcome is StepOutcome.STEPPED and self.lr_scheduler is not None:  # not after a skipped step, as DeepSpeed
            self.lr_scheduler.step()
        self._last_step_time = log_step(self, self._last_step_time)
        # the norm as a device tensor: the monitor reads it only when it writes events (no sync per step otherwise)
        self.monitor.after_step(self.global_step, self.get_lr()[0], self.loss_scale,
                                self.optimizer.last_grad_norm_tensor)

    def _on_nonfinite(self) -> None:
        """Every rank is here together (the norm is global): name the cause, then stop or skip."""
        loss_finite = True if self._loss_finite is None else bool(self._loss_finite)
        message = describe(self.global_step, self.optimizer.last_grad_norm, loss_finite, self.units,
                           self.param_names, self.process_group)
        if self.config.nonfinite is NonFinitePolicy.STOP:
            raise NonFiniteError(f"{message}. Nothing was written to the parameters or optimizer state. "
                                 f"Lower the learning rate, enable gradient_clipping, check the data, or set "
                                 f"\"nonfinite\": \"skip\" to skip such steps")
        self.nonfinite_steps += 1
        if self.rank == 0:
            log.warning("zerodp: skipped %s (nonfinite: skip; %d such steps so far)", message, self.nonfinite_steps)

    def sync_written_shards(self) -> None:
        """Bring the fp32 masters up to date with shards written outside the optimizer (stage 3's
        gathered_parameters(modifier_rank=...)); done before anything reads the masters."""
        written = {id(u) for u in self.sharding.take_written_units()}
        for index, unit in enumerate(self.units):
            if id(unit) in written:
                self.optimizer.load_master_from_shard(index)

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate schedule stepped after every optimizer step taken (None: none); saved in checkpoints."""
        return self._lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, schedule: Any) -> None:
        """Replace the schedule (None: none, as Lightning sets it); see optim/client_schedule.py."""
        self._lr_scheduler = engine_schedule(schedule, self)

    # -- read-only figures -----------------------------------------------------------------------

    @property
    def at_step_boundary(self) -> bool:
        """True between optimizer steps: no gradient has been accumulated since the last one."""
        return self.micro_step % self.gradient_accumulation_steps == 0 and not self._backward_since_step

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def grad_norm(self) -> Optional[float]:
        """Global gradient norm of the last step, before clipping (None after a skipped step)."""
        return self.optimizer.last_grad_norm

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer param group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def compile(self, **compile_kwargs) -> None:
        """`torch.compile` the model in place (`module.compile(**compile_kwargs)`); stage 3's gather hooks are
        re-registered to run eagerly between the compiled graphs."""
        self.sharding.prepare_for_compile()
        self.module.compile(**compile_kwargs)

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        if mode:
            self._release_kept_units()
        return self

    def _release_kept_units(self) -> None:
        self.sharding.release_kept_units()  # stage 3 keeps units gathered between evaluation forwards

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def memory_report(self) -> MemoryReport:
        """This rank's parameter, gradient and optimizer bytes, measured and as the paper predicts."""
        return measure_memory(self)

    def comms_summary(self) -> str:
        """comms_logger's table of this rank's collectives (count, bytes, latency; logged on rank 0)."""
        return self.monitor.comms_summary()

    # -- checkpoints (see checkpoint.py) --------------------------------------------------------

    @_under_lease
    def save_checkpoint(self, save_dir, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        deepspeed_layout: bool = False) -> str:
        """Every rank writes its own shards under save_dir/tag, unit by unit; returns the checkpoint's path.
        `deepspeed_layout=True` also writes DeepSpeed's ZeRO files into it (stages 1-3, no tensor parallelism), for
        DeepSpeed's tools and DeepSpeed itself (checkpoint/deepspeed_writer.py, docs/checkpoints.md)."""
        self._activity.enter("checkpoint")
        self.sync_written_shards()
        if self.expert_parallel:  # whole tensors named as in the single-process model: moe/checkpoint.py
            from ..moe.checkpoint import save_expert_checkpoint

            return save_expert_checkpoint(self, self.sharding.plan, save_dir, tag, client_state)
        def save(root):
            return save_checkpoint(self, root, tag=tag, client_state=client_state)
        path = save(save_dir) if self.mpu is None else tp_save(self.mpu, self.rank, self.module, save_dir, save)
        if deepspeed_layout:
            if self.mpu is not None:
                raise CheckpointError("save_checkpoint(deepspeed_layout=True) with tensor parallelism: DeepSpeed's "
                                      "layout is written for data parallelism only; the zerodp checkpoint was saved")
            write_deepspeed_layout(self, path, client_state)
        return path

    @_under_lease
    def load_checkpoint(self, load_dir, tag: Optional[str] = None, load_lr_scheduler: bool = True) -> dict:
        """Resume from a checkpoint (any world size or stage), unit by unit; returns the saved client_state.
        `load_lr_scheduler=False` keeps this engine's schedule (DeepSpeed's load_lr_scheduler_states)."""
        self._activity.enter("checkpoint")
        self._release_kept_units()  # their gathered values are about to go stale
        if self.expert_parallel:  # any expert-parallel or data-parallel size: moe/checkpoint.py
            from ..moe.checkpoint import load_expert_checkpoint

            client_state = load_expert_checkpoint(self, self.sharding.plan, load_dir, tag, load_lr_scheduler)
            self.sharding.after_step()  # note: a collective; re-assembles full parameters from the loaded shards
            return client_state
        if self.mpu is not None:  # each tensor-parallel rank reads its own directory (checkpoint/tensor_parallel.py)
            load_dir = tp_rank_dir(self.mpu, load_dir, saved=True)
        resumed = read_checkpoint(self, load_dir, tag=tag, load_lr_scheduler=load_lr_scheduler)
        self.scaler.load_state_dict(resumed.loss_scaler)
        if resumed.lr_scheduler is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(resumed.lr_scheduler)
        counters = resumed.counters
        self.global_step, self.skipped_steps = counters["global_step"], counters["skipped_steps"]
        same_accumulation = counters["gradient_accumulation_steps"] == self.gradient_accumulation_steps
        self.micro_step = counters["micro_step"] if same_accumulation else self.global_step * self.gradient_accumulation_steps
        self.sharding.after_step()  # note: a collective; re-assembles full parameters from the loaded shards
        if resumed.rng is not None:  # ranks beyond the saved world size keep their own RNG states
            set_rng_state(resumed.rng)
        return resumed.client_state

    @_under_lease
    def save_dcp(self, path, model_key: str = "model") -> str:
        """Write model and optimizer state as a torch distributed checkpoint (DCP) in folder `path`, in the keys
        FSDP2's get_state_dict uses (checkpoint/dcp.py); every rank writes only its own shard."""
        self._refuse_dcp_with_tensor_parallel()
        self._activity.enter("checkpoint")
        self.sync_written_shards()
        return save_dcp(self, path, model_key=model_key)

    @_under_lease
    def load_dcp(self, path, load_optimizer: bool = True, load_lr_scheduler: bool = True,
                 model_key: Optional[str] = None) -> None:
        """Resume from a DCP checkpoint that FSDP2, torchtitan or `save_dcp` wrote, at any world size or stage:
        parameters, optimizer state and step counts. From zerodp's own export also the step counters, loss
        scaler and (unless `load_lr_scheduler=False`) the lr schedule; from another writer's the global step is
        torchtitan's train_state.step, else the largest Adam step, and the schedule is left as it is."""
        self._refuse_dcp_with_tensor_parallel()
        self._activity.enter("checkpoint")
        self._release_kept_units()  # their gathered values are about to go stale
        resumed = read_dcp(self, path, load_optimizer=load_optimizer, model_key=model_key,
                           load_lr_scheduler=load_lr_scheduler)
        if resumed.counters is not None:
            counters = resumed.counters
            self.scaler.load_state_dict(counters["loss_scaler"])
            self.global_step, self.skipped_steps = counters["global_step"], counters["skipped_steps"]
            same_accumulation = counters["gradient_accumulation_steps"] == self.gradient_accumulation_steps
            self.micro_step = counters["micro_step"] if same_accumulation else \
                self.global_step * self.gradient_accumulation_steps
        else:
            self.global_step = resumed.train_step if resumed.train_step is not None else resumed.optimizer_step
            self.skipped_steps = 0
            self.micro_step = self.global_step * self.gradient_accumulation_steps
        if resumed.lr_scheduler is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(resumed.lr_scheduler)
        self.sharding.after_step()  # note: a collective; re-assembles full parameters from the loaded shards

    def _refuse_dcp_with_tensor_parallel(self) -> None:
        if self.mpu is not None:
            raise CheckpointError("DCP export and import do not cover tensor-parallel engines yet; use "
                              "save_checkpoint / load_checkpoint (one folder per tensor-parallel rank)")

    @_under_lease
    def full_state_dict(self, rank0_only: bool = True) -> dict:
        """The full model state dict (fp32 parameters, buffers), on CPU; empty on other ranks if rank0_only.
        With expert-parallel MoE layers: the single-process model's, every expert under its global index."""
        if self.expert_parallel:
            from ..moe.consolidate import expert_full_state_dict

            return expert_full_state_dict(self, self.sharding.plan, rank0_only=rank0_only)
        self.sync_written_shards()
        with self.sharding.all_resident():  # offload_param: full_state_dict reads every shard at once
            return full_state_dict(self, rank0_only=rank0_only)

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release what the engine created: hooks, the stage-3 parameter registry's entries, the communicators
        and I/O threads it made, offload files, and the default process group if zerodp initialized it.

        Idempotent. Call it (or use the engine as a context manager) when training ends; an atexit
        hook does the same at interpreter exit (see [Note: teardown] in comm/process_group.py). The offload
        tier's files are deleted too (otherwise at garbage collection or exit). After close() the engine
        can no longer communicate; a process group the caller created is left alone, and so is one another
        live engine uses (runtime.py).
        """
        self.monitor.close()  # the comms_logger summary is logged here
        # hooks, the stage-3 parameter registry's entries, its reduction communicator, the offloaded shards'
        # files (the engine cannot train after this)
        self.sharding.close()
        self.optimizer.close()  # the offload tier's stores, files and I/O threads, if any
        self._lease.close()  # the last engine out ends the default group zerodp made, the watchdog, mallopt

    def __enter__(self) -> "ZeroEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def initialize(model: nn.Module, optimizer: Any = None, config: Any = None,
               process_group: comm.ProcessGroup = None, *, cast_inputs: bool = True,
               lr_scheduler: Any = None, mpu: Any = None) -> ZeroEngine:
    """Wrap `model` for ZeRO training as `config` says (README's quick start). The one place an engine is built:
    the DeepSpeed and VISSL entries translate and call this. `optimizer=None`: the config's `optimizer` section
    builds it (an error says so where there is none). `cast_inputs=False`: inputs keep their dtype.
    `lr_scheduler`: a schedule over `optimizer` (or a callable building one on the engine's optimizer),
    stepped after every optimizer step taken, instead of a config `scheduler` section. `mpu`: Megatron's model-
    parallel unit of a tensor-parallel model: ZeRO shards over its data-parallel group (optim/model_parallel.py)."""
    config = load_config(config)
    created = comm.init_distributed(RUNTIME.backend_timeout_s(config))
    group = process_group if mpu is None else data_parallel_group(mpu, process_group)  # what ZeRO shards over
    if not created:  # a group made elsewhere (or an earlier engine's): which host each of its ranks runs on, now
        comm.topology.learn_hosts(group)  # (hpZ and MiCS size their blocks by it; comm/topology.py)
    lease = RUNTIME.lease(config, comm.get_rank(group), group, checkpointing=True)  # DeepSpeed's section, if any
    try:
        place_module(model, group)  # NCCL: a CPU-built model to cuda:LOCAL_RANK ([Note: a CPU-built model under NCCL])
        return ZeroEngine(model, optimizer, config, process_group, cast_inputs, lr_scheduler=lr_scheduler,
                          lease=lease, mpu=mpu)
    except BaseException:
        lease.close()  # an engine that failed to build holds nothing of the process
        raise
