"""Where a strategy's peak live bytes sit within one step: malloc in-use bytes at labelled events.

    torchrun --standalone --nproc_per_node 2 bench/live_memory_timeline.py --strategy zerodp3 [--events]

The same model, data and strategies as the benchmark harness (bench/harness). After a few warm-up steps,
one step runs with a thread sampling `in_use_bytes()` (glibc mallinfo2, as the bench's peak) every
0.2 ms, and with in-use bytes read synchronously at events: forward, backward and step for every
strategy; for zerodp also each flat unit's gather, wait and release, each module unit's pre-backward
and release, each gradient shard's add, launch and wait, and the optimizer step (their methods are
wrapped here, in this script only). Rank 0 prints the in-use bytes between steps, at the end of the
forward and at the start of the backward, the sampled peak with the last event before it, and with
`--events` every event. Used for bench/results/live_memory_issue21.md.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.distributed as dist

from bench.harness.live_memory import in_use_bytes
from bench.harness.models import BENCH_MODELS
from bench.harness.strategies import STRATEGIES
from bench.harness.worker import mean_over_ranks, train_step
from zerodp.tools.models.gpt import GPT

MIB = 2 ** 20


class Timeline:
    """Labelled in-use readings (synchronous) and a background sampler's readings, for one step."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, str]] = []
        self.samples: list[tuple[float, int]] = []
        self.on = False
        self._stop = threading.Event()

    def mark(self, label: str) -> None:
        if self.on:
            self.events.append((time.perf_counter(), in_use_bytes(), label))

    def traced(self, fn, label: str):
        def call(*args, **kwargs):
            self.mark("> " + label)
            out = fn(*args, **kwargs)
            self.mark("< " + label)
            return out
        return call

    def trace_methods(self, cls, names: list[str]) -> None:
        for name in names:
            original = getattr(cls, name)

            def call(obj, *args, _original=original, _name=name, **kwargs):
                who = getattr(obj, "module_name", None) or getattr(obj, "name", "")
                label = f"{cls.__name__}.{_name} {who}"
                self.mark("> " + label)
                out = _original(obj, *args, **kwargs)
                self.mark("< " + label)
                return out
            setattr(cls, name, call)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), in_use_bytes()))
            self._stop.wait(0.0002)

    def __enter__(self) -> "Timeline":
        self.on = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.mark("start")
        return self

    def __exit__(self, *exc) -> None:
        self.mark("end")
        self.on = False
        self._stop.set()
        self._thread.join()


def trace_zerodp(timeline: Timeline) -> None:
    from zerodp.shard.grads.grad_shard import GradShard
    from zerodp.optim.optimizer import ShardedOptimizer
    from zerodp.shard.stage3.flat_unit import FlatUnit
    from zerodp.shard.stage3.module_unit import ModuleUnit

    timeline.trace_methods(FlatUnit, ["unshard", "wait_for_unshard", "reshard"])
    timeline.trace_methods(ModuleUnit, ["pre_backward", "release_backward_hold"])
    timeline.trace_methods(GradShard, ["add_grad", "launch", "wait"])
    timeline.trace_methods(ShardedOptimizer, ["step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="zerodp3", choices=sorted(STRATEGIES))
    ap.add_argument("--model", default="baseline", choices=sorted(BENCH_MODELS))
    ap.add_argument("--warmup", type=int, default=3, help="steps before the traced one (prefetch needs one)")
    ap.add_argument("--events", action="store_true", help="print every event")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    timeline = Timeline()
    if args.strategy.startswith("zerodp"):
        trace_zerodp(timeline)
    cfg = BENCH_MODELS[args.model]
    torch.manual_seed(0)
    runner = STRATEGIES[args.strategy](GPT(cfg))
    for step in range(args.warmup):
        mean_over_ranks(train_step(runner, cfg, step, rank, 4))
    runner.forward = timeline.traced(runner.forward, "forward")
    runner.backward = timeline.traced(runner.backward, "backward")
    runner.step = timeline.traced(runner.step, "step")
    dist.barrier()
    with timeline:
        mean_over_ranks(train_step(runner, cfg, args.warmup, rank, 4))
    if rank == 0:
        at = {label: b for _, b, label in timeline.events}
        peak_t, peak = max(timeline.samples, key=lambda s: s[1])
        before = [e for e in timeline.events if e[0] <= peak_t]
        print(f"{args.strategy}: between steps {at['start'] / MIB:.1f} MiB, end of forward {at['< forward'] / MIB:.1f}, "
              f"backward start {at['> backward'] / MIB:.1f}, sampled peak {peak / MIB:.1f} "
              f"({(peak_t - before[-1][0]) * 1e3:.1f} ms after '{before[-1][2]}')")
        if args.events:
            t0 = timeline.events[0][0]
            for t, b, label in timeline.events:
                print(f"{(t - t0) * 1e3:9.1f} ms {b / MIB:8.1f} MiB  {label}")
    dist.barrier()
    del runner
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
