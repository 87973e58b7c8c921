"""What stage 3's gather check costs (issue 42 part 1; stage3/gather_ledger.py): the step time of zerodp stage 3
with the check over the same engine without it (bench/harness/strategies.py's zerodp3_nocheck), both in one
process pair and stepped in turn (bench/harness/interleaved.py), so the per-step ratio is taken seconds apart.

    python -m bench.gather_check_cost [--model small] [--steps 45] [--results bench/results/gather_check_cost.md]

Reports the median per-step ratio (with check / without) over the timed steps, and how noisy it is: the
ratios' interquartile range and a 95% interval of the median (bootstrap over steps). Both strategies train the
same model from the same weights, so their losses must agree bitwise (the check changes no arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ratios(ranks: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Per timed step (the last two thirds): the slower rank's time with the check, without, and their ratio."""
    steps = len(ranks[0]["step_times"]["zerodp3"])
    timed = range(steps // 3, steps)
    on = [max(r["step_times"]["zerodp3"][i] for r in ranks) for i in timed]
    off = [max(r["step_times"]["zerodp3_nocheck"][i] for r in ranks) for i in timed]
    return on, off, [a / b for a, b in zip(on, off)]


def median_interval(values: list[float], rounds: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds)]


def host_work_s(model: str) -> tuple[float, int]:
    """The check's own host work per step, timed directly: at most two gathers per unit (forward and backward)
    recorded, and one settle and verify (the agreeing path); returns (seconds, gathers counted)."""
    import time

    import torch

    from zerodp.config import load_config
    from zerodp.tools.models.gpt import GPT
    from zerodp.shard.stage3.gather_ledger import GatherLedger
    from zerodp.shard.stage3.wrap import units_for
    from bench.harness.models import BENCH_MODELS

    with torch.device("meta"):
        gpt = GPT(BENCH_MODELS[model])
    gathers = 2 * len(units_for(gpt, load_config({"zero_optimization": {"stage": 3}}).zero_optimization))
    ledger = GatherLedger(None, torch.device("cpu"))
    rounds = 2000
    t0 = time.perf_counter()
    for _ in range(rounds):
        for i in range(gathers):
            ledger.record(i)
        values = ledger.settle()
        ledger.verify([v for v in values])  # what the MAX all-reduce returns when every rank agrees
    return (time.perf_counter() - t0) / rounds, gathers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--results", default=str(ROOT / "bench/results/gather_check_cost.md"))
    ap.add_argument("--nocheck-first", action="store_true",
                    help="build (and step first) the engine without the check: shows any effect of the order")
    args = ap.parse_args(argv)
    out = Path(args.results).with_suffix(".json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "bench.harness.interleaved", "--strategies",
           *(["zerodp3_nocheck", "zerodp3"] if args.nocheck_first else ["zerodp3", "zerodp3_nocheck"]), "--model", args.model,
           "--steps", str(args.steps), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"gather_check_cost: the run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    ranks = json.loads(out.read_text())
    on, off, r = ratios(ranks)
    q1, _, q3 = statistics.quantiles(r, n=4)
    lo, hi = median_interval(r)
    host_s, gathers = host_work_s(args.model)
    losses = ranks[0]["losses"]
    same = losses["zerodp3"] == losses["zerodp3_nocheck"]
    command = "python -m bench.gather_check_cost " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = (f"# Stage 3's gather check: its cost on the step\n\n`{command}` (2 gloo ranks, {args.model} GPT, default "
            f"stage-3 config, {args.steps} steps per strategy stepped in turn, the last two thirds timed; "
            f"{'the engine without the check built and stepped first' if args.nocheck_first else 'the engine with the check built and stepped first'}; "
            f"{os.cpu_count()} CPUs, shared machine)\n\n"
            f"| | median step s |\n|---|---|\n| zerodp3 (check on) | {statistics.median(on):.4f} |\n"
            f"| zerodp3_nocheck | {statistics.median(off):.4f} |\n\n"
            f"Median per-step ratio (on / off): **{statistics.median(r):.4f}** "
            f"(95% interval of the median {lo:.4f}-{hi:.4f}; per-step ratios' interquartile range "
            f"{q1:.4f}-{q3:.4f}, over {len(r)} steps).\n"
            f"Losses of the two runs bitwise equal: {same}.\n\n"
            f"The check's own host work, timed directly ({gathers} gathers recorded, one settle and verify): "
            f"{host_s * 1e6:.1f} us per step, {100 * host_s / statistics.median(off):.4f}% of the step; its "
            f"other cost is 24 bytes more in the control all-reduce the step already makes (latency-bound).\n")
    Path(args.results).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
