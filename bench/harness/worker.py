"""One benchmark run: one strategy on N ranks under torchrun; writes every rank's figures as JSON.

    torchrun --standalone --nproc_per_node 2 -m bench.harness.worker --strategy zerodp3 --out x.json

The timed steps run first, with nothing else in the process; then MEMORY_STEPS more steps run under
the live-memory sampler (its thread would perturb the timings) and, for zerodp, under comm.record()
for the traffic. Losses cover every step, so they can be compared with DDP's bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerodp import comm
from zerodp.tools.models.gpt import GPT
from .live_memory import PeakSampler
from .models import BENCH_MODELS, synthetic_tokens
from .strategies import STRATEGIES

MEMORY_STEPS = 2
# Paper volume per element: an all-reduce moves 2x its buffer (reduce-scatter + all-gather).
_VOLUME = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}


def _traffic_bytes(log: comm.CommLog) -> int:
    return sum(r.nbytes * _VOLUME.get(r.op, 1) for r in log.records)


def train_step(runner, cfg, step: int, rank: int, micro_batch: int) -> torch.Tensor:
    """One optimizer step of `runner` on this rank's synthetic micro-batch of `step`; the local loss."""
    tokens = synthetic_tokens(step, rank, micro_batch, cfg.block_size, cfg.vocab_size)
    logits = runner.forward(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
    runner.backward(loss)
    runner.step()
    return loss.detach()


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The loss averaged over the default group's ranks (what DDP's run is compared on)."""
    total = loss.clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", required=True, choices=sorted(STRATEGIES))
    ap.add_argument("--model", default="baseline", choices=sorted(BENCH_MODELS))
    ap.add_argument("--steps", type=int, default=20, help="timed steps (the first half is warm-up)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = BENCH_MODELS[args.model]
    torch.manual_seed(0)
    model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    runner = STRATEGIES[args.strategy](model)
    losses, times, live_peaks, traffic = [], [], [], None

    def one_step(step: int, runner=runner) -> None:  # bound here: `runner` is deleted before teardown
        losses.append(mean_over_ranks(train_step(runner, cfg, step, rank, args.micro_batch)))

    for step in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        one_step(step)
        times.append(time.perf_counter() - t0)
    for step in range(args.steps, args.steps + MEMORY_STEPS):
        dist.barrier()
        with comm.record() as log, PeakSampler() as sampler:
            one_step(step)
        live_peaks.append(sampler.peak)
        traffic = _traffic_bytes(log) if log.records else None
    result = {
        "strategy": args.strategy, "model": args.model, "world_size": world, "rank": rank,
        "params": numel, "losses": losses, "step_times": times,
        "model_state_bytes": runner.model_state_bytes(), "predicted_state_bytes": runner.predicted_state_bytes(),
        "peak_live_bytes": max((p for p in live_peaks if p is not None), default=None),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "traffic_bytes_per_step": traffic,
        "torch": torch.__version__, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    del one_step, runner, model  # DDP's reducer must go before its process group, or gloo aborts at exit
    gc.collect()  # closures and cycles may still hold it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
