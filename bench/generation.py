"""Stage 3 at evaluation and generation: greedy generate() and Trainer.evaluate(), unsharded vs stage 3.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/generation.py --out bench/results/generation

Two models built from configs (no download): an HF GPT-2 (4 layers, width 128, GPT-2's 50257-token
vocabulary) and zerodp's bundled GPT ("small" preset, 3.3M parameters). Each generates 64 tokens
greedily from the same 8-token prompt on every rank, in four modes built side by side in one process
pair and run in turn (odd rounds in reverse order, so drift of the shared machine hits every mode alike):

    unsharded       the plain model, one copy per rank
    stage3          zerodp stage 3, default budget (stage3_inference_memory_fraction 0.5: holds the model)
    stage3-quarter  stage3_max_live_parameters = a quarter of the sharded elements
    stage3-nocache  stage3_inference_memory_fraction 0: every forward re-gathers (the behaviour before)

Every parameter is sharded (stage3_param_persistence_threshold 0), units are the transformer blocks.
Before each timed generate() the stage-3 engines get `engine.train()` (which releases everything
kept), so each timing includes the first forward's gathers, as in a generate-then-train loop.
x unsharded is the median over rounds of each round's ratio; (best) the ratio of the fastest rounds; (CPU s)
the median ratio of the process CPU time (all threads, gloo's included), less sensitive to other jobs on
the machine than wall time. The floor of a mode that re-gathers: bytes
all-gathered per token / the all-gather bandwidth measured here on the largest unit (zerodp's own
comm.all_gather); `overhead / floor` says how close the extra time per token is to it.

Trainer.evaluate(): the same HF GPT-2 through the plain Trainer (unsharded) and ZeroTrainer at stage 3
with the default budget and with the cache off, after one training step each (ZeroTrainer builds its
engine in train()), 16 eval batches of 4 x 64 tokens per rank, timed in turn.
Rank 0 prints a table and writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import zerodp  # noqa: E402
from zerodp import comm  # noqa: E402
from zerodp.tools.models.gpt import GPT, MODEL_PRESETS  # noqa: E402

NEW_TOKENS, PROMPT = 64, 8
EVAL_BATCHES = 16  # per rank, of 4 x 64 tokens
MODES = ("unsharded", "stage3", "stage3-quarter", "stage3-nocache")


def hf_gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=128, n_embd=128, n_layer=4, n_head=4)
    return transformers.GPT2LMHeadModel(config)


def bundled_gpt():
    return GPT(MODEL_PRESETS["small"], seed=0)


def stage3_config(unit: str, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_unit_modules": [unit], "stage3_param_persistence_threshold": 0, **zero}}


def sharded_numel(engine) -> int:
    return sum(f.layout.padded_numel for f in engine.sharding.flats if not f.persistent)


def build(make, unit: str) -> dict:
    """The four modes' models (and engines) of one architecture."""
    models = {"unsharded": (make(), None)}
    probe = make()
    quarter = sharded_numel(zerodp.initialize(probe, torch.optim.SGD(probe.parameters(), lr=0.0),
                                              stage3_config(unit))) // 4
    for mode, zero in (("stage3", {}), ("stage3-quarter", {"stage3_max_live_parameters": quarter}),
                       ("stage3-nocache", {"stage3_inference_memory_fraction": 0.0})):
        model = make()
        models[mode] = (model, zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                                 stage3_config(unit, **zero)))
    for model, _ in models.values():
        model.eval()
    return models


def generate(kind: str, model, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if kind == "hf":
            return model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0, attention_mask=torch.ones_like(prompt))
        return model.generate(prompt, NEW_TOKENS, temperature=0)


def gather_bandwidth(numel: int, repeats: int = 5) -> float:
    """Bytes of gathered output per second of zerodp's all_gather on this group (median of `repeats`)."""
    world = dist.get_world_size()
    shard = torch.randn(numel // world)
    full = torch.empty(shard.numel() * world)
    comm.all_gather(full, shard)  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        comm.all_gather(full, shard)
        times.append(time.perf_counter() - start)
    return full.numel() * full.element_size() / statistics.median(times)


def bench_generation(kind: str, make, unit: str, rounds: int) -> dict:
    models = build(make, unit)
    vocab = 50257 if kind == "hf" else 256
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    times, cpu = {m: [] for m in MODES}, {m: [] for m in MODES}
    tokens, gathered = {}, {}
    for m in MODES:  # warm-up (and the stage-3 engines record their unit order)
        generate(kind, models[m][0], prompt)
    for r in range(rounds):
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            model, engine = models[m]
            if engine is not None:
                engine.train()  # release what the last call kept: every timing starts from sharded units
                engine.eval()
            dist.barrier()
            with comm.record() as log:
                start, start_cpu = time.perf_counter(), time.process_time()
                tokens[m] = generate(kind, model, prompt)
                times[m].append(time.perf_counter() - start)
                cpu[m].append(time.process_time() - start_cpu)
            gathered[m] = sum(rec.nbytes for rec in log.of("all_gather", "param"))
    largest = max(f.layout.padded_numel for f in models["stage3"][1].sharding.flats)
    bandwidth = gather_bandwidth(largest)
    base = times["unsharded"]
    out = {"bandwidth_bytes_per_s": bandwidth, "modes": {}}
    for m in MODES:
        per_token = statistics.median(times[m]) / NEW_TOKENS
        floor = gathered[m] / NEW_TOKENS / bandwidth
        overhead = per_token - statistics.median(base) / NEW_TOKENS
        out["modes"][m] = {
            "median_s": statistics.median(times[m]), "times_s": times[m],
            "x_unsharded": statistics.median(t / b for t, b in zip(times[m], base)),
            "x_unsharded_best": min(times[m]) / min(base), "cpu_s": cpu[m],
            "x_unsharded_cpu": statistics.median(t / b for t, b in zip(cpu[m], cpu["unsharded"])),
            "per_token_ms": 1e3 * per_token, "gathered_mib_per_token": gathered[m] / NEW_TOKENS / 2**20,
            "floor_ms_per_token": 1e3 * floor, "overhead_over_floor": overhead / floor if floor else None,
            "tokens_equal_unsharded": bool(torch.equal(tokens[m], tokens["unsharded"]))}
    return out


class EvalSet(torch.utils.data.Dataset):
    def __init__(self, rows: int, seq: int = 64) -> None:
        self.ids = torch.randint(0, 50257, (rows, seq), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def bench_evaluate(rounds: int, out_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from zerodp.adapters.hf.trainer import ZeroTrainer

    world = dist.get_world_size()
    data = EvalSet(EVAL_BATCHES * 4 * world)
    trainers = {}
    for mode, zero in (("unsharded", None), ("stage3", {}), ("stage3-nocache", {"stage3_inference_memory_fraction": 0.0})):
        args = TrainingArguments(output_dir=os.path.join(out_dir, mode), per_device_train_batch_size=4,
                                 per_device_eval_batch_size=4, max_steps=1, learning_rate=1e-4, report_to=[],
                                 use_cpu=True, ddp_backend="gloo", disable_tqdm=True, save_strategy="no",
                                 dataloader_drop_last=True, seed=0)
        if zero is None:
            trainer = Trainer(model=hf_gpt2(), args=args, train_dataset=data, eval_dataset=data)
        else:
            config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                      "train_batch_size": "auto", "zero_optimization": {
                          "stage": 3, "stage3_unit_modules": ["GPT2Block"], "stage3_param_persistence_threshold": 0,
                          **zero}}
            trainer = ZeroTrainer(model=hf_gpt2(), args=args, train_dataset=data, eval_dataset=data,
                                  zero_config=config)
        trainer.train()
        trainer.evaluate()  # warm-up
        trainers[mode] = trainer
    times, cpu = {m: [] for m in trainers}, {m: [] for m in trainers}
    losses = {}
    for r in range(rounds):
        for m in (list(trainers) if r % 2 == 0 else list(trainers)[::-1]):
            trainers[m].model.train()  # as after training steps: nothing kept from the last evaluate
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[m] = trainers[m].evaluate()["eval_loss"]
            times[m].append(time.perf_counter() - start)
            cpu[m].append(time.process_time() - start_cpu)
    base = times["unsharded"]
    return {m: {"median_s": statistics.median(t), "times_s": t, "cpu_s": cpu[m],
                "x_unsharded": statistics.median(a / b for a, b in zip(t, base)),
                "x_unsharded_best": min(t) / min(base),
                "x_unsharded_cpu": statistics.median(a / b for a, b in zip(cpu[m], cpu["unsharded"])),
                "eval_loss": losses[m]}
            for m, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/generation")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="4 tokens, 1 round, 2 eval batches: checks the script")
    args = parser.parse_args()
    global NEW_TOKENS, EVAL_BATCHES
    if args.smoke:
        NEW_TOKENS, EVAL_BATCHES, args.rounds = 4, 2, 1
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    results = {"world_size": dist.get_world_size(), "torch": torch.__version__,
               "omp_threads": torch.get_num_threads(), "new_tokens": NEW_TOKENS, "rounds": args.rounds,
               "load_average": os.getloadavg()}
    results["hf_gpt2"] = bench_generation("hf", hf_gpt2, "GPT2Block", args.rounds)
    results["bundled_gpt"] = bench_generation("gpt", bundled_gpt, "Block", args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path)
        results["evaluate"] = bench_evaluate(args.rounds, path[0])
        dist.barrier()
    results["load_average_end"] = os.getloadavg()
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        print(render(results))
    dist.destroy_process_group()


def render(results: dict) -> str:
    lines = [f"greedy generation of {NEW_TOKENS} tokens, {results['world_size']} ranks, median of "
             f"{results['rounds']} rounds; load average {results['load_average']} -> {results['load_average_end']}",
             "", "| model | mode | s / generate | x unsharded | x unsharded (best) | x unsharded (CPU s) | ms / token "
             "| gathered MiB / token | floor ms / token | overhead / floor | tokens = unsharded |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("hf_gpt2", "bundled_gpt"):
        r = results[name]
        for m, v in r["modes"].items():
            ratio = "-" if v["overhead_over_floor"] is None else f"{v['overhead_over_floor']:.2f}"
            lines.append(f"| {name} | {m} | {v['median_s']:.3f} | {v['x_unsharded']:.2f} | {v['x_unsharded_best']:.2f} | "
                         f"{v['x_unsharded_cpu']:.2f} | {v['per_token_ms']:.2f} | "
                         f"{v['gathered_mib_per_token']:.2f} | {v['floor_ms_per_token']:.2f} | {ratio} | "
                         f"{v['tokens_equal_unsharded']} |")
        lines.append(f"| {name} | gather bandwidth | {r['bandwidth_bytes_per_s'] / 2**30:.2f} GiB/s | | | | | | | | |")
    lines += ["", "| Trainer.evaluate() | s | x unsharded | x unsharded (best) | x unsharded (CPU s) | eval_loss |",
              "|---|---|---|---|---|---|"]
    for m, v in results["evaluate"].items():
        lines.append(f"| {m} | {v['median_s']:.3f} | {v['x_unsharded']:.2f} | {v['x_unsharded_best']:.2f} | "
                     f"{v['x_unsharded_cpu']:.2f} | {v['eval_loss']:.6f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
