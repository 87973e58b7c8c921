"""`ZeroTrainer`: the Hugging Face `Trainer`, training with zerodp instead of DDP.

    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=..., zero_config="zero.json")
    trainer.train()                       # or train(resume_from_checkpoint="out/checkpoint-20"), any world size
    trainer.save_model("out/final")       # one consolidated model: AutoModel...from_pretrained loads it

How it fits the Trainer's loop (transformers >= 5):
  - "auto" values of `zero_config` are filled from the TrainingArguments (`hf_auto.fill_auto`).
  - The Trainer's optimizer (`create_optimizer`: its class, groups and weight decay) is handed to
    `zerodp.initialize`, which rebuilds it over this rank's fp32 master shards; an `optimizer` section in
    `zero_config` is used instead when present. The Trainer's scheduler (`lr_scheduler_type`, warmup)
    drives the masters' param groups.
  - `training_step` runs backward through the engine (which divides by the accumulation steps and
    reduces gradients by ZeRO's stage) and `engine.step()`, which steps the optimizer and clips at the
    accumulation boundary; the Trainer's own `optimizer.step()` is then a no-op and the logged
    grad_norm is the engine's global pre-clip norm.
  - `save_steps` checkpoints write the consolidated model plus zerodp's sharded checkpoint (tag
    "zerodp") into checkpoint-N/; resume reshards it to the current world size and stage.
The model is not wrapped in DDP: zerodp does the gradient reduction. Epochs must hold a multiple of
gradient_accumulation_steps batches (zerodp accumulates full windows); otherwise an error says so.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("zerodp.adapters.hf.trainer needs transformers: pip install 'zerodp[hf]'") from err

from ... import initialize
from ...config import ConfigError
from .auto_values import fill_auto, read_zero_config

CHECKPOINT_TAG = "zerodp"
SCHEDULER_FILE = "scheduler.pt"

for _hook in ("_prepare_for_training", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
              "_clip_grad_norm", "_wrap_model"):
    if not hasattr(Trainer, _hook):  # private Trainer methods ZeroTrainer overrides; renamed in another version
        raise ImportError(f"ZeroTrainer needs transformers.Trainer.{_hook} (transformers 5.x); this transformers "
                          f"version does not have it")


class _EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer sees as its optimizer: the engine's master-shard param groups (so the Trainer's
    LR scheduler sets their lr) and a `step()` that does nothing, because the engine already stepped
    at the accumulation boundary inside `training_step`."""

    def __init__(self, engine) -> None:  # no super().__init__: the engine owns parameters and state
        self.engine = engine
        self.defaults = dict(engine.optimizer.param_groups[0]) if engine.optimizer.param_groups else {}
        self.defaults.pop("params", None)
        self.state = {}

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine clears its gradient buckets after each step

    def state_dict(self):
        raise RuntimeError("ZeroTrainer saves optimizer state through zerodp's sharded checkpoint")

    def __repr__(self) -> str:
        return f"_EngineOptimizer(stage={self.engine.stage})"


class _EngineScheduler:
    """What the Trainer sees as its LR scheduler when `zero_config` has a `scheduler` section: the engine's
    schedule (DeepSpeed's WarmupLR, ...), which the engine steps after each optimizer step, as under
    HF + DeepSpeed; the Trainer's own `step()` here does nothing, so the schedule advances once per step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.used = engine.get_lr()  # the lr of the optimizer step in progress (what the Trainer logs for it)

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        # note: the Trainer asks after training_step, where the engine has already stepped and advanced the
        # schedule; it logs the lr the step used, as it does with its own scheduler (asked before stepping it)
        return self.used

    def state_dict(self) -> dict:
        return self.engine.lr_scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.lr_scheduler.load_state_dict(state)


class ZeroTrainer(Trainer):
    """A `transformers.Trainer` whose model trains with zerodp's ZeRO (stage from `zero_config`)."""

    def __init__(self, *args, zero_config: Union[dict, str, os.PathLike], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.zero_config_source = read_zero_config(zero_config)
        self.engine = None

    # -- set-up ------------------------------------------------------------------------------------

    def resolved_zero_config(self, max_steps: Optional[int] = None) -> dict:
        """zero_config with every "auto" filled from the TrainingArguments (scheduler steps from `max_steps`)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return fill_auto(self.zero_config_source, self.args, world, self.model, max_steps=max_steps)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        # No DDP: zerodp reduces the gradients. Registering the model with accelerate keeps evaluation from
        # "preparing" it again (model.to(device) would touch stage-3 partitioned parameters).
        if self.engine is not None and not any(m is self.model for m in self.accelerator._models):
            self.accelerator._models.append(self.model)
        return self.model

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        config = self.resolved_zero_config(max_steps)
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        elif "scheduler" in config and self.lr_scheduler is not None and not isinstance(self.lr_scheduler,
                                                                                           _EngineScheduler):
            # two schedules over one optimizer: the second would overwrite the first's lr (or capture lr 0)
            raise ConfigError(f"two LR schedulers: zero_config's scheduler section ({config['scheduler'].get('type')}) "
                              f"and the {type(self.lr_scheduler).__name__} passed in optimizers=(...); keep one")
        if self.engine is None:
            optimizer = None
            if "optimizer" not in config:
                self.create_optimizer()  # the Trainer's choice: class, decay / no-decay groups, hyper-parameters
                optimizer = self.optimizer
            self.engine = initialize(self.model, optimizer, config)
            self.optimizer = _EngineOptimizer(self.engine)
        if "scheduler" in config:  # the config's schedule is the schedule, as under HF + DeepSpeed
            self.lr_scheduler = _EngineScheduler(self.engine)
        else:
            self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    # -- the step ----------------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        engine = self.engine
        sync = self.accelerator.gradient_state.sync_gradients
        if sync != engine.is_accumulation_boundary:
            raise ConfigError(f"the Trainer ends an accumulation window where zerodp does not (micro-step "
                              f"{engine.micro_step}, gradient_accumulation_steps={engine.gradient_accumulation_steps})"
                              f": make the batches per epoch a multiple of gradient_accumulation_steps")
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(self.model, inputs, num_items_in_batch=num_items_in_batch)
        gas = engine.gradient_accumulation_steps
        if self._loss_is_scaled_for_ga(num_items_in_batch):
            # The Trainer's loss is already sum / (tokens in the whole window[, times world size when tokens
            # are averaged across ranks]), i.e. divided for accumulation and ready for DDP's mean over ranks.
            # The engine divides by the accumulation steps and takes the mean over ranks itself, so it is
            # given gas x that loss: the gradient is then exactly the Trainer's (DDP's).
            engine.backward(loss * gas)
            logged = loss.detach()
        else:
            engine.backward(loss)  # a micro-batch mean; the engine divides by the accumulation steps
            logged = loss.detach() / gas
        if isinstance(self.lr_scheduler, _EngineScheduler) and engine.is_accumulation_boundary:
            self.lr_scheduler.used = engine.get_lr()  # before engine.step() advances the config's schedule
        engine.step()  # at the boundary: clip, optimizer step on the shards, gather (the Trainer's step is a no-op)
        return logged  # what the Trainer sums over micro-steps and divides by optimizer steps

    def _loss_is_scaled_for_ga(self, num_items_in_batch) -> bool:
        """The Trainer's own rule (training_step) for whether compute_loss already divided for accumulation."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def _clip_grad_norm(self, model):
        return self.engine.grad_norm  # pre-clip global norm over all shards; the engine already clipped

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.grad_norm if grad_norm is None else grad_norm

    # -- checkpoints and the saved model -----------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write one consolidated model (every rank must call it: the parameters are gathered)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        state_dict = self.engine.full_state_dict(rank0_only=True)  # collective: every rank takes part
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir, tag=CHECKPOINT_TAG)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        pass  # the engine's checkpoint (fp32 masters and weights) is loaded once the engine exists

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        if not os.path.isdir(os.path.join(checkpoint, CHECKPOINT_TAG)):
            raise ConfigError(f"{checkpoint} has no zerodp checkpoint ('{CHECKPOINT_TAG}/'); resume from a "
                              f"checkpoint-N folder that ZeroTrainer wrote")
        self.engine.load_checkpoint(checkpoint, tag=CHECKPOINT_TAG)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))

    def _save_scaler(self, output_dir: str) -> None:
        pass  # the loss scale is part of zerodp's checkpoint

    def _load_scaler(self, checkpoint) -> None:
        pass
