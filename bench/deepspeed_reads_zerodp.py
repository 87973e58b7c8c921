"""DeepSpeed 0.19.8's own tools on checkpoints zerodp's adapter wrote (issue 40, part 2). Two phases, 2 gloo ranks:

    # 1. zerodp trains the parity model 3 steps per case, saves (its default: zerodp's format + DeepSpeed's layout +
    #    zero_to_fp32.py beside latest), trains 3 more steps and records them
    PHASE=zerodp OUT=/tmp/ds_reads_zerodp PYTHONPATH=src OMP_NUM_THREADS=1 \
        /work/dsvenv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/deepspeed_reads_zerodp.py
    # 2. real DeepSpeed reads each checkpoint: get_fp32_state_dict_from_zero_checkpoint, the zero_to_fp32.py zerodp
    #    put beside latest, and load_checkpoint followed by the same 3 steps; compared with zerodp's
    PHASE=deepspeed OUT=/tmp/ds_reads_zerodp PYTHONPATH=src DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \
        /work/dsvenv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/deepspeed_reads_zerodp.py

Phase 2 writes bench/results/deepspeed_reads_zerodp.md and .json. Phase 1 imports `zerodp.deepspeed` (never
DeepSpeed); phase 2 imports DeepSpeed (zerodp only for the parity model's data, tests/dist/common.py).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.dist.common import make_model, micro_batch, param_groups  # noqa: E402
from tests.fixtures.deepspeed_ckpt.loop import GAS, LR, MICRO_BS, dtype_of, layout_config as config  # noqa: E402
from tests.fixtures.deepspeed_ckpt.loop import train as train_steps  # noqa: E402

PHASE, OUT = os.environ["PHASE"], Path(os.environ["OUT"])
if PHASE == "deepspeed":
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # as in tests/fixtures/deepspeed_ckpt/make_fixtures.py
else:
    import zerodp.deepspeed as deepspeed

CASES = {"s1_fp32": (1, "fp32"), "s2_fp32": (2, "fp32"), "s3_fp32": (3, "fp32"), "s2_bf16": (2, "bf16"),
         "s3_bf16": (3, "bf16"), "s2_fp16": (2, "fp16")}


def train(engine, first: int, steps: int, dtype) -> tuple[list, list]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return train_steps(engine, first, steps, lambda step, micro: micro_batch(step, micro, rank, world, MICRO_BS, GAS),
                       dtype)


def masters(engine) -> dict:
    return {n: deepspeed.utils.safe_get_full_fp32_param(p).detach().float().clone()
            for n, p in engine.module.named_parameters() if p.requires_grad}


def make_engine(stage: int, precision: str, seed: int):
    model = make_model(seed)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model, 1e-2), lr=LR),
                                      config=config(stage, precision))
    return engine


def zerodp_phase() -> None:
    results = {}
    for name, (stage, precision) in CASES.items():
        engine = make_engine(stage, precision, seed=0)
        train(engine, 0, 3, dtype_of(precision))
        saved = {k: v.float() for k, v in engine.full_state_dict(rank0_only=False).items()}
        engine.save_checkpoint(str(OUT / name), client_state={"epoch": 7})
        losses, lrs = train(engine, 3, 3, dtype_of(precision))
        results[name] = {"saved": saved, "losses": losses, "lrs": lrs, "masters": masters(engine),
                         "counters": [engine.global_steps, engine.skipped_steps]}
        engine.destroy() if name == list(CASES)[-1] else None
    if dist.get_rank() == 0:
        torch.save(results, OUT / "zerodp.pt")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def deepspeed_phase() -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    rank = dist.get_rank()
    zerodp = torch.load(OUT / "zerodp.pt", weights_only=False)
    rows = []
    for name, (stage, precision) in CASES.items():
        z = zerodp[name]
        row = {"case": name}
        if rank == 0:
            state = get_fp32_state_dict_from_zero_checkpoint(str(OUT / name))
            row["get_fp32_state_dict_from_zero_checkpoint"] = max_diff(state, z["saved"])
            out = OUT / f"{name}_fp32.pt"
            subprocess.run([sys.executable, str(OUT / name / "zero_to_fp32.py"), str(OUT / name), str(out)],
                           check=True, capture_output=True)
            row["zero_to_fp32.py beside latest"] = max_diff(torch.load(out, weights_only=True), z["saved"])
        engine = make_engine(stage, precision, seed=123)
        _, client = engine.load_checkpoint(str(OUT / name))
        losses, lrs = train(engine, 3, 3, dtype_of(precision))
        got = masters(engine)
        row.update({"load_checkpoint: client_state": client.get("epoch"),
                    "losses (DeepSpeed)": losses, "losses (zerodp)": z["losses"],
                    "max |loss diff|": max(abs(a - b) for a, b in zip(losses, z["losses"])),
                    "lrs equal": lrs == z["lrs"],
                    # DeepSpeed steps a parameter that got no gradient (unused.*) with a zero one, so AdamW's weight
                    # decay still shrinks it; torch and zerodp leave it: compared apart
                    "max |fp32 master diff|": max_diff(*({k: v for k, v in d.items() if not k.startswith("unused.")}
                                                         for d in (got, z["masters"]))),
                    "unused.weight diff": max_diff({"w": got["unused.weight"]}, {"w": z["masters"]["unused.weight"]}),
                    "counters equal": [engine.global_steps, engine.skipped_steps] == z["counters"]})
        rows.append(row)
    if rank == 0:
        results = ROOT / "bench" / "results"
        (results / "deepspeed_reads_zerodp.json").write_text(json.dumps(rows, indent=1) + "\n")
        lines = ["# DeepSpeed 0.19.8 reads checkpoints zerodp wrote (issue 40, part 2)", "",
                 "Made by bench/deepspeed_reads_zerodp.py (commands in its docstring): zerodp's DeepSpeed adapter "
                 "trained the parity model (tests/dist/common.py) 3 steps on 2 gloo ranks (AdamW, WarmupLR, clipping "
                 "0.05, 2 micro-batches per step), saved with its default format, and trained 3 more steps; real "
                 "DeepSpeed then read each checkpoint: `get_fp32_state_dict_from_zero_checkpoint` and the "
                 "zero_to_fp32.py zerodp put beside `latest` (max |difference| from zerodp's saved fp32 weights), and "
                 "`load_checkpoint` into a model with other initial weights followed by the same 3 steps (compared "
                 "with zerodp's 3 steps after its save). The last column is a parameter that never gets a gradient: DeepSpeed "
                 "steps it with a zero gradient, so AdamW's weight decay shrinks it (w *= 1 - lr * 0.01 per step), "
                 "where torch's AdamW and zerodp leave it.", "",
                 "Commands (from the repository root):", "", "```",
                 "PHASE=zerodp OUT=/tmp/ds_reads_zerodp PYTHONPATH=src OMP_NUM_THREADS=1 /work/dsvenv/bin/python -m "
                 "torch.distributed.run --nproc_per_node 2 bench/deepspeed_reads_zerodp.py",
                 "PHASE=deepspeed OUT=/tmp/ds_reads_zerodp PYTHONPATH=src DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 "
                 "/work/dsvenv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/deepspeed_reads_zerodp.py",
                 "```", "", f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, CPU, gloo.", "",
                 "| case | get_fp32_state_dict_from_zero_checkpoint | zero_to_fp32.py | client state | max loss diff | "
                 "lrs equal | max fp32 master diff | counters equal | unused.weight diff |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['case']} | {r['get_fp32_state_dict_from_zero_checkpoint']:.1e} | "
                         f"{r['zero_to_fp32.py beside latest']:.1e} | {r['load_checkpoint: client_state']} | "
                         f"{r['max |loss diff|']:.1e} | {r['lrs equal']} | {r['max |fp32 master diff|']:.1e} | "
                         f"{r['counters equal']} | {r['unused.weight diff']:.1e} |")
        (results / "deepspeed_reads_zerodp.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    if PHASE == "zerodp":
        dist.init_process_group("gloo")
        OUT.mkdir(parents=True, exist_ok=True)
        zerodp_phase()
    else:
        deepspeed.init_distributed("gloo")
        deepspeed_phase()
