"""One rank of the stock-Trainer acceptance run (tests/hf/test_frameworks_on_zerodp.py), launched as a DeepSpeed user
launches it with zerodp in DeepSpeed's place, the only change:

    python -m torch.distributed.run --nproc_per_node 2 -m zerodp.deepspeed.run tests/hf/stock_trainer_worker.py OUT

The stock `transformers.Trainer` with `TrainingArguments(deepspeed=<transformers' own template>)`, gradient
accumulation 2, trains the tiny GPT-2 (tests/hf/tiny_setup.py) for STEPS steps; rank 0 writes OUT/trainer.json with,
per case, the Trainer's log (loss, lr, grad norm per step), the lr each optimizer step used (LrProbe) and the engine
it trained with. Cases:
    reference-zero2 / reference-zero3  the plain Trainer (DDP, 2 gloo ranks) with the optimizer and schedule DeepSpeed
                                       builds from the template: AdamW over all parameters, WarmupLR by its formula
    zero2   transformers' tests/deepspeed/ds_config_zero2.json, unchanged ("auto" everywhere; offload_optimizer cpu);
            saves checkpoint-SAVE_AT through the Trainer
    zero2-resume   a new Trainer resumed from that checkpoint (`train(resume_from_checkpoint=...)`)
    zero3   transformers' tests/deepspeed/ds_config_zero3.json with one change: fp16.enabled true -> "auto" (the suite is
            fp32 on CPU); its hard-coded optimizer and schedule values are given to TrainingArguments, which HF requires
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer

from tests.hf.tiny_setup import LrProbe, Sequences, arguments, history, make_model, schedule_factor

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"
STEPS, SAVE_AT = 4, 2
# the zero3 template's hard-coded values (HF refuses TrainingArguments that contradict them); no gradient_clipping
# in it, so neither run clips (a bound the norms never reach keeps the Trainer computing and logging them)
ZERO3_ARGS = dict(learning_rate=3e-5, adam_beta1=0.8, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=3e-7,
                  warmup_steps=500, max_grad_norm=1e9)


def _arguments(out: str, name: str, **overrides):
    base = dict(max_steps=STEPS, eval_strategy="no", save_strategy="no", warmup_steps=2)
    if name.startswith("zero3") or name == "reference-zero3":
        base.update(ZERO3_ARGS)
    return arguments(f"{out}/{name}", **{**base, **overrides})


def reference(out: str, name: str, data) -> dict:
    """DeepSpeed's optimizer (the config's AdamW, one group of every parameter) and schedule (WarmupLR) in the plain
    Trainer; the Trainer's own clipping and accumulation."""
    args = _arguments(out, name)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                            eps=args.adam_epsilon, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, schedule_factor({"type": "WarmupLR"}, args.warmup_steps, STEPS))
    probe = LrProbe()
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, schedule), callbacks=[probe])
    trainer.train()
    probe.close()
    return {**history(trainer), "lr_used": probe.used}


def zero3_template(out: str) -> str:
    config = json.loads((CONFIG_DIR / "transformers__ds_config_zero3.json").read_text())
    config["fp16"]["enabled"] = "auto"  # the one change (module docstring)
    path = Path(out, "ds_config_zero3.json")
    if dist.get_rank() == 0:
        path.write_text(json.dumps(config))
    dist.barrier()
    return str(path)


def deepspeed_run(out: str, name: str, config: str, data, **overrides) -> dict:
    resume = overrides.pop("resume_from_checkpoint", None)
    probe = LrProbe()
    trainer = Trainer(model=make_model(), args=_arguments(out, name, deepspeed=config, **overrides), train_dataset=data,
                      callbacks=[probe])
    trainer.train(resume_from_checkpoint=resume)
    probe.close()
    engine = trainer.model_wrapped
    return {**history(trainer), "lr_used": probe.used, "engine": f"{type(engine).__module__}.{type(engine).__name__}",
            "stage": engine.zero_optimization_stage(), "gas": engine.gradient_accumulation_steps()}


def main(out: str) -> None:
    data = Sequences()
    zero2 = str(CONFIG_DIR / "transformers__ds_config_zero2.json")
    results = {name: reference(out, name, data) for name in ("reference-zero2", "reference-zero3")}
    results["zero2"] = deepspeed_run(out, "zero2", zero2, data, save_strategy="steps", save_steps=SAVE_AT)
    results["zero2-resume"] = deepspeed_run(out, "zero2-resume", zero2, data,
                                            resume_from_checkpoint=f"{out}/zero2/checkpoint-{SAVE_AT}")
    results["zero3"] = deepspeed_run(out, "zero3", zero3_template(out), data)
    if dist.get_rank() == 0:
        Path(out, "trainer.json").write_text(json.dumps(results))


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    main(sys.argv[1])
