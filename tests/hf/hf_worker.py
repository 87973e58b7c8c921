"""One rank of the ZeroTrainer acceptance runs (launched by tests/hf/test_zero_trainer.py via torchrun).

    python -m torch.distributed.run --nproc_per_node 2 tests/hf/hf_worker.py train OUT
        trains a tiny GPT-2 (from a config, no download) with the plain Trainer (DDP) and with ZeroTrainer
        at stages 2 and 3 on the same arguments and seed; writes OUT/results.json (rank 0)
    python -m torch.distributed.run --nproc_per_node 3 tests/hf/hf_worker.py resume OUT
        resumes the stage-3 run from OUT/stage3/checkpoint-3 on 3 ranks; writes OUT/resume.json
    python -m torch.distributed.run --nproc_per_node 2 tests/hf/hf_worker.py resume_offload OUT
        resumes the offloaded bf16 stage-3 run (`train` wrote it, see `offloaded`) from OUT/offload/checkpoint-3
        on the same 2 ranks; writes OUT/resume_offload.json
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

from zerodp.config import ConfigError
from zerodp.adapters.hf.trainer import ZeroTrainer

from tests.hf.tiny_setup import SEQ, VOCAB, Sequences, arguments, history, make_model, schedule_factor

MAX_STEPS, SAVE_STEPS = 6, 3


ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "train_batch_size": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": None, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto", "stage3_unit_modules": ["GPT2Block"]}}


def zero_config(stage: int) -> dict:
    config = json.loads(json.dumps(ZERO))
    config["zero_optimization"]["stage"] = stage
    if stage != 3:
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_unit_modules"):
            del config["zero_optimization"][key]
    else:
        del config["zero_optimization"]["reduce_bucket_size"]
    return config


def train(out: str) -> None:
    data, evaluation = Sequences(), Sequences(rows=16, seed=4)
    results = {}
    plain = Trainer(model=make_model(), args=arguments(f"{out}/ddp"), train_dataset=data, eval_dataset=evaluation)
    plain.train()
    results["ddp"] = history(plain)
    probe = torch.arange(SEQ).unsqueeze(0) % VOCAB
    for stage in (2, 3):
        trainer = ZeroTrainer(model=make_model(), args=arguments(f"{out}/stage{stage}"), train_dataset=data,
                              eval_dataset=evaluation, zero_config=zero_config(stage))
        trainer.train()
        results[f"stage{stage}"] = history(trainer)
        results[f"stage{stage}_zero"] = trainer.engine.config.zero_optimization.model_dump()
        trainer.save_model(f"{out}/stage{stage}/final")
        trainer.model.eval()
        with torch.no_grad():
            live = trainer.model(probe).logits  # stage 3: gathered by zerodp's hooks on every rank
        if dist.get_rank() == 0:
            loaded = AutoModelForCausalLM.from_pretrained(f"{out}/stage{stage}/final")
            with torch.no_grad():
                results[f"stage{stage}_logits_maxdiff"] = (loaded(probe).logits - live).abs().max().item()
        dist.barrier()
    results.update(hf_template(out, data))
    results.update(offloaded(out, data))
    if dist.get_rank() == 0:
        with open(f"{out}/results.json", "w") as fh:
            json.dump(results, fh)


TEMPLATE = Path(__file__).resolve().parents[1] / "configs" / "deepspeed" / "transformers__ds_config_zero2.json"


def hf_template(out: str, data) -> dict:
    """transformers' own DeepSpeed template (every value "auto", a WarmupLR scheduler section), unchanged, against
    the plain Trainer driven by the same schedule and optimizer (AdamW over every parameter, as DeepSpeed builds
    it from the config's optimizer section); then two schedulers at once, which must be refused."""
    args = arguments(f"{out}/template", eval_strategy="no", save_strategy="no")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                            eps=args.adam_epsilon, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, schedule_factor({"type": "WarmupLR"}, args.warmup_steps, MAX_STEPS))
    plain = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, schedule))
    plain.train()
    zero = ZeroTrainer(model=make_model(), args=arguments(f"{out}/template-zero", eval_strategy="no",
                                                          save_strategy="no"),
                       train_dataset=data, zero_config=str(TEMPLATE))
    zero.train()
    before = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    moved = max((zero.engine.full_state_dict(rank0_only=False)[n] - before[n]).abs().max().item() for n in before)
    model = make_model()
    other = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1), lambda s: 1.0)
    twice = ZeroTrainer(model=model, args=arguments(f"{out}/twice", eval_strategy="no", save_strategy="no"), train_dataset=data,
                        zero_config=str(TEMPLATE), optimizers=(None, other))
    try:
        twice.train()
        refusal = None
    except ConfigError as err:
        refusal = str(err)
    return {"template_ref": history(plain), "template": history(zero), "template_moved": moved,
            "two_schedulers": refusal}


def offload_config(nvme: str) -> dict:
    """Stage 3 in bf16 with both offloads on nvme. max_in_cpu 0: no parameter shard stays cached beyond the
    ones in use, so each goes through its file between uses (unset, the tiny model's 3 units would all fit in
    the default working set of buffer_count shards and no shard would ever be written back)."""
    os.makedirs(nvme, exist_ok=True)
    config = zero_config(3)
    config["zero_optimization"].update(offload_param={"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
                                       offload_optimizer={"device": "nvme", "nvme_path": nvme})
    return config


def offload_arguments(output_dir: str):
    # bf16 here fills the config's bf16.enabled "auto"; no evaluation: the resume is what this run checks
    return arguments(output_dir, bf16=True, eval_strategy="no")


def offloaded(out: str, data) -> dict:
    """The uninterrupted offloaded run: 6 steps, checkpoint-3 and checkpoint-6 (save_steps 3); with what shows
    that the run was offloaded bf16 (the compute dtype, the bytes in the nvme files, per rank)."""
    trainer = ZeroTrainer(model=make_model(), args=offload_arguments(f"{out}/offload"), train_dataset=data,
                          zero_config=offload_config(f"{out}/nvme-train"))
    trainer.train()
    report = trainer.engine.memory_report()
    evidence = comm_gather({"disk_bytes": report.disk_bytes, "owned_numel": report.owned_numel,
                            "param_dtype": str(next(trainer.model.parameters()).dtype)})
    trainer.engine.close()  # its nvme files go; the resume is another launch
    return {"offload": history(trainer), "offload_ranks": evidence}


def comm_gather(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


class FirstStepProbe(TrainerCallback):
    """Records the full parameters at the first step after the resume (collective: every rank calls it)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.params = trainer, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.params is None:
            self.params = self.trainer.engine.full_state_dict(rank0_only=True)


def resume_and_probe(checkpoint: str, args, zero_config_: dict):
    """A fresh ZeroTrainer resumed from `checkpoint`; returns it, the checkpoint's saved parameters (rank 0;
    None elsewhere) and the largest difference between them and the parameters the first resumed step saw."""
    from safetensors.torch import load_file

    trainer = ZeroTrainer(model=make_model(), args=args, train_dataset=Sequences(), zero_config=zero_config_)
    probe = FirstStepProbe(trainer)
    trainer.add_callback(probe)
    trainer.train(resume_from_checkpoint=checkpoint)
    if dist.get_rank() != 0:
        return trainer, None, None
    saved = load_file(f"{checkpoint}/model.safetensors")
    return trainer, saved, max((probe.params[k].float() - v.float()).abs().max().item() for k, v in saved.items())


def resume(out: str) -> None:
    trainer, saved, diff = resume_and_probe(f"{out}/stage3/checkpoint-{SAVE_STEPS}",
                                            arguments(f"{out}/resumed", eval_strategy="no"), zero_config(3))
    if saved is not None:
        fresh = make_model().state_dict()
        moved = max((fresh[k].float() - v.float()).abs().max().item() for k, v in saved.items())
        with open(f"{out}/resume.json", "w") as fh:
            json.dump({"world": dist.get_world_size(), "global_step": trainer.state.global_step,
                       "resume_param_maxdiff": diff, "checkpoint_moved": moved, **history(trainer)}, fh)


def resume_offload(out: str) -> None:
    """A fresh launch resumes the offloaded run from checkpoint-3 (same world, same arguments)."""
    trainer, saved, diff = resume_and_probe(f"{out}/offload/checkpoint-{SAVE_STEPS}",
                                            offload_arguments(f"{out}/resumed-offload"),
                                            offload_config(f"{out}/nvme-resume"))
    if saved is not None:
        with open(f"{out}/resume_offload.json", "w") as fh:
            json.dump({"global_step": trainer.state.global_step, "resume_param_maxdiff": diff,
                       "compared": len(saved), **history(trainer)}, fh)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    {"train": train, "resume": resume, "resume_offload": resume_offload}[mode](out)
