"""Every strategy in one pair of processes, stepped in turn: step-time ratios that machine drift cannot skew.

    torchrun --standalone --nproc_per_node 2 -m bench.harness.interleaved --strategies ddp zerodp3 --out x.json

Why: on a shared 2-core VM the speed wanders by 10-15% within minutes, and runs of one strategy after
another (runner.py's rounds) compare moments as much as strategies: in one session the same zerodp3
build measured 1.01x and 1.23x DDP in two such benchmarks. Here each rank builds every strategy's
model and optimizer up front, then runs step k of every strategy back to back (odd steps in reverse
order), so that each step's ratio to DDP is taken within seconds; the figure is the median of those
per-step ratios over the timed steps. Memory is not measured here (all strategies share the process);
runner.py's rounds measure it. Losses are compared like runner.py's: bitwise to DDP's.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zerodp.tools.models.gpt import GPT
from .models import BENCH_MODELS
from .strategies import STRATEGIES
from .worker import mean_over_ranks, train_step


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process: gloo's included
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", required=True, choices=sorted(STRATEGIES))
    ap.add_argument("--model", default="baseline", choices=sorted(BENCH_MODELS))
    ap.add_argument("--steps", type=int, default=18, help="steps per strategy (the first third is warm-up)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = BENCH_MODELS[args.model]
    runners = {}
    for name in args.strategies:
        torch.manual_seed(0)  # every strategy starts from the same weights
        runners[name] = STRATEGIES[name](GPT(cfg))
    times = {n: [] for n in runners}
    cpu = {n: [] for n in runners}
    losses = {n: [] for n in runners}
    for step in range(args.steps):
        order = list(runners) if step % 2 == 0 else list(runners)[::-1]
        for name in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), _cpu_s()
            loss = train_step(runners[name], cfg, step, rank, args.micro_batch)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(_cpu_s() - c0)
            losses[name].append(mean_over_ranks(loss))
    result = {"rank": rank, "world_size": world, "model": args.model, "steps": args.steps,
              "step_times": times, "cpu_times": cpu, "losses": losses, "torch": torch.__version__}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    del runners  # DDP's reducer must go before its process group, or gloo aborts at exit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
