"""One rank of the HF-template sweep (launched by tests/hf/test_hf_templates.py via torchrun, 2 gloo ranks).

    python -m torch.distributed.run --nproc_per_node 2 tests/hf/template_worker.py OUT NAME.json [NAME.json ...]

For each named config of tests/configs/deepspeed/ (unchanged), ZeroTrainer trains the tiny GPT-2 for STEPS steps;
rank 0 writes OUT/templates.json with, per config: the Trainer's log (loss, logged lr), the lr every optimizer step
used (LrProbe), how far the parameters moved, the batch sizes and stage the engine resolved, and the seconds it took.

The plain Trainer (DDP, 2 ranks) is run once per kind of arithmetic the configs ask for, under "reference:<kind>":
    optimizer  "trainer": the Trainer's own AdamW (decay / no-decay groups), when the config has no optimizer;
               "config":  AdamW over every parameter with the config's hyper-parameters, as DeepSpeed builds it
                          from an `optimizer` section (HF hands it all trainable parameters in one group);
    schedule   the Trainer's linear warmup, or the config's scheduler type with DeepSpeed's semantics (LambdaLR
               over schedule_factor: the formula, not zerodp's implementation).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer

from zerodp.adapters.hf.trainer import ZeroTrainer

from tests.hf.tiny_setup import LrProbe, Sequences, arguments, history, make_model, schedule_factor

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"
STEPS, WARMUP = 6, 3  # warmup 3 (not 2): DeepSpeed's log warmup then gives three distinct lrs before the plateau


def template_arguments(out: str):
    bf16 = os.environ.get("ZERODP_HF_TEMPLATES_BF16") == "1"  # the templates' bf16 "auto" then turns bf16 on
    return arguments(out, max_steps=STEPS, warmup_steps=WARMUP, eval_strategy="no", save_strategy="no", bf16=bf16)


def kind_of(config: dict) -> str:
    optimizer = "config" if "optimizer" in config else "trainer"
    return f"{optimizer}+{config.get('scheduler', {}).get('type', 'trainer')}"


def reference(kind: str, out: str, data) -> dict:
    optimizer_kind, schedule_kind = kind.split("+")
    args = template_arguments(f"{out}/reference-{kind}")
    model = make_model()
    optimizers = (None, None)
    if optimizer_kind == "config":
        opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                eps=args.adam_epsilon, weight_decay=args.weight_decay)
        schedule = None  # the Trainer builds its linear schedule over the given optimizer (as under HF + DeepSpeed)
        if schedule_kind != "trainer":
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, schedule_factor({"type": schedule_kind}, WARMUP, STEPS))
        optimizers = (opt, schedule)
    elif schedule_kind != "trainer":
        raise NotImplementedError(f"{kind}: a scheduler section without an optimizer section; add its reference")
    probe = LrProbe()
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers, callbacks=[probe])
    trainer.train()
    probe.close()
    return {**history(trainer), "lr_used": probe.used}


def zero_run(name: str, out: str, data) -> dict:
    started = time.perf_counter()
    probe = LrProbe()
    trainer = ZeroTrainer(model=make_model(), args=template_arguments(f"{out}/{name}"), train_dataset=data,
                          zero_config=str(CONFIG_DIR / name), callbacks=[probe])
    trainer.train()
    probe.close()
    engine = trainer.engine
    initial = make_model().state_dict()
    final = engine.full_state_dict(rank0_only=False)  # collective: every rank takes part
    moved = max((final[n].float() - initial[n].float()).abs().max().item() for n in final)
    config = engine.config
    return {**history(trainer), "lr_used": probe.used, "moved": moved, "stage": engine.stage,
            "batch": list(config.resolve_batch(dist.get_world_size())), "bf16": bool(config.bf16.enabled),
            "scheduler": trainer.resolved_zero_config(STEPS).get("scheduler"),
            "seconds": time.perf_counter() - started}


def main(out: str, names: list[str]) -> None:
    data = Sequences()
    results = {}
    for name in names:
        kind = kind_of(json.loads((CONFIG_DIR / name).read_text()))
        if f"reference:{kind}" not in results:
            results[f"reference:{kind}"] = reference(kind, out, data)
        results[name] = {**zero_run(name, out, data), "kind": kind}
    if dist.get_rank() == 0:
        Path(out, "templates.json").write_text(json.dumps(results))


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    main(sys.argv[1], sys.argv[2:])
