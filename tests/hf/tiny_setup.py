"""The tiny GPT-2, its data and TrainingArguments, and the per-step records shared by the HF tests' workers and by
the real-DeepSpeed recorder (record_hf_deepspeed.py runs in the bench venv, without zerodp: nothing here imports it).

Also the learning-rate schedules written out from their definitions, so a test can check the lr each optimizer
step used against the formula rather than against another implementation:
    DeepSpeed's WarmupLR / WarmupDecayLR (0.19.8, runtime/lr_schedules.py), as its engine steps them: built with
        last_batch_iteration = -1, so the first optimizer step runs at warmup_min_lr; after optimizer step j
        (1-based) the engine calls step(), giving last_batch_iteration i = j - 1 and
            gamma(i) = log(i + 1) / log(W)          (warmup_type "log", the default)  while i < W, W = max(2, warmup)
                     = i / W                        (warmup_type "linear")             while i < W
                     = 1                            (WarmupLR)                         after
                     = max(0, (T - i) / max(1, T - W))  (WarmupDecayLR, T = total_num_steps)  after
        lr = min + (max - min) * gamma(i)
    the Trainer's "linear" schedule (get_linear_schedule_with_warmup): step k (0-based) runs at
        lr * k / W while k < W, then lr * max(0, (T - k) / max(1, T - W)).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

SEQ, VOCAB, ROWS = 12, 48, 96


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class Sequences(torch.utils.data.Dataset):
    """Arithmetic progressions mod VOCAB: learnable, so the loss falls within a few steps."""

    def __init__(self, rows: int = ROWS, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (rows, 1), generator=g)
        step = torch.randint(1, 4, (rows, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out: str, **overrides) -> TrainingArguments:
    kw = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
              learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0,
              logging_steps=1, save_steps=3, eval_strategy="steps", eval_steps=3,
              per_device_eval_batch_size=4, seed=0, report_to=[], use_cpu=True, ddp_backend="gloo",
              dataloader_drop_last=True, save_only_model=False, disable_tqdm=True)
    kw.update(overrides)
    return TrainingArguments(**kw)


def history(trainer) -> dict:
    logs = trainer.state.log_history
    return {"loss": [e["loss"] for e in logs if "loss" in e], "lr": [e["learning_rate"] for e in logs if "loss" in e],
            "grad_norm": [None if e.get("grad_norm") is None else float(e["grad_norm"]) for e in logs if "loss" in e],
            "eval_loss": [e["eval_loss"] for e in logs if "eval_loss" in e],
            "steps": [e["step"] for e in logs if "loss" in e]}


class LrProbe(TrainerCallback):
    """The learning rates every torch optimizer step used, per Trainer step (a global step pre-hook, so it sees the
    optimizer that really steps: the Trainer's, DeepSpeed's inner one, or zerodp's master-shard one, whichever it
    is). `used[k]` is the sorted set of distinct lrs of step k+1's optimizer steps: one value when one schedule
    drives every param group; an empty list when no optimizer stepped (a silently idle step)."""

    def __init__(self) -> None:
        self.pending: set[float] = set()
        self.used: list[list[float]] = []
        self.handle = register_optimizer_step_pre_hook(self._seen)

    def _seen(self, optimizer, args, kwargs) -> None:
        self.pending.update(float(g["lr"]) for g in optimizer.param_groups if g["params"])

    def on_step_end(self, args, state, control, **kwargs):
        self.used.append(sorted(self.pending))
        self.pending = set()

    def close(self) -> None:
        self.handle.remove()


def schedule_factor(scheduler: Optional[dict], warmup: int, total: int) -> Callable[[int], float]:
    """lr / learning_rate at optimizer step k (0-based) under the config's `scheduler` section (filled as the HF
    integration fills it: min 0, max learning_rate, warmup_num_steps = warmup, total_num_steps = total), or under
    the Trainer's linear schedule when the config has none. See the module docstring for the formulas."""
    if scheduler is None:
        return lambda k: k / max(1, warmup) if k < warmup else max(0.0, (total - k) / max(1, total - warmup))
    kind, params = scheduler["type"], scheduler.get("params", {})
    if kind not in ("WarmupLR", "WarmupDecayLR"):
        raise ValueError(f"no reference formula for DeepSpeed's {kind}; add one here")
    w = max(2, warmup)
    log_rate = params.get("warmup_type", "log") == "log"

    def gamma(i: int) -> float:
        if i < w:
            return math.log(i + 1) / math.log(w) if log_rate else i / w
        return 1.0 if kind == "WarmupLR" else max(0.0, (total - i) / max(1.0, total - w))

    return lambda k: 0.0 if k == 0 else gamma(k - 1)  # min lr 0: the first step runs at it
