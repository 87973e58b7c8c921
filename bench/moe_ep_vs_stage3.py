"""Expert parallelism against stage 3 on the same MoE (issue 42): step time and bytes moved per step, side by side.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 -m bench.moe_ep_vs_stage3 [--steps 30] \
        [--results bench/results/moe_ep_vs_stage3.md]

Two engines in every process over the same model shape (width 256, 8 experts of 256 -> 512 -> 256 in each of
2 blocks, top-2, 32 tokens per rank), stepped in turn so each step-time ratio is taken seconds apart:
  stage3   the classic MoE (experts in a ModuleList, a top-2 router) at ZeRO stage 3 with the default unit
           policy: every rank holds a 1/N shard of every expert and gathers each block whole, forward and backward
  ep2      DeepSpeed's MoE layer (zerodp.moe.MoE, ep_size 2, capacity factor 2) at stage 3: each rank holds 4 of
           the 8 experts whole (ZeRO-sharded over its expert-data-parallel pair), tokens travel by all-to-all
Bytes are every collective's payload as comm/collectives.py records it (comm.add_observer), per rank and step,
by operation. Times are the slower rank's per step, the first third of the steps left out (warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp import comm
from zerodp.moe import MoE

WIDTH, EXPERTS, LAYERS, TOKENS, IN, OUT = 256, 8, 2, 32, 16, 8
ROOT = Path(__file__).resolve().parents[1]


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.w2 = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(h)))


class ClassicMoE(nn.Module):
    """Top-2 over a ModuleList of experts; an expert no token reaches is not called."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        top, chosen = torch.topk(self.router(h), 2, dim=-1)
        weights = F.softmax(top, dim=-1)
        out = torch.zeros_like(h)
        for e in sorted(set(chosen.flatten().tolist())):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out = out.index_add(0, rows, weights[rows, slot, None] * self.experts[e](h[rows]))
        return out


class ParallelMoE(nn.Module):
    """DeepSpeed's MoE layer with its experts split over `ep_size` ranks; returns the output alone."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.moe = MoE(WIDTH, Expert(), num_experts=EXPERTS, ep_size=ep_size, k=2, capacity_factor=2.0,
                       min_capacity=4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out, _, _ = self.moe(h)
        return out


class Block(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = moe

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class Net(nn.Module):
    def __init__(self, make_moe) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList(Block(make_moe()) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Bytes:
    """Bytes of every collective this rank issues, by operation, while recording."""

    def __init__(self) -> None:
        self.by_op: dict[str, int] = defaultdict(int)

    def issued(self, record: comm.CommRecord, entry, skipped: bool) -> None:
        if not skipped:
            self.by_op[record.op] += record.nbytes


def engine_for(name: str, seed: int):
    torch.manual_seed(seed)
    model = Net(ClassicMoE) if name == "stage3" else Net(lambda: ParallelMoE(2))
    config = {"train_micro_batch_size_per_gpu": TOKENS, "zero_optimization": {"stage": 3}}
    return zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, IN, generator=g), torch.randn(TOKENS, OUT, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--results", default=str(ROOT / "bench/results/moe_ep_vs_stage3.md"))
    parser.add_argument("--only", choices=["stage3", "ep2"], help="one engine alone (diagnosis; writes no results)")
    args = parser.parse_args()
    engines = {name: engine_for(name, 0) for name in ("stage3", "ep2") if args.only in (None, name)}
    rank, world = dist.get_rank(), dist.get_world_size()
    times: dict[str, list[float]] = {name: [] for name in engines}
    moved: dict[str, Bytes] = {}
    for step in range(args.steps):
        for name, engine in engines.items():
            x, y = batch(step, rank)
            counter = Bytes() if step == args.steps - 1 else None  # one steady step's bytes
            if counter is not None:
                comm.add_observer(counter)
            dist.barrier()
            t0 = time.perf_counter()
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
            elapsed = torch.tensor([time.perf_counter() - t0])
            if counter is not None:
                comm.remove_observer(counter)
                moved[name] = counter
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's step
            times[name].append(elapsed.item())
    if rank == 0 and args.only is None:
        timed = range(args.steps // 3, args.steps)
        ratios = [times["ep2"][i] / times["stage3"][i] for i in timed]
        lines = ["# Expert parallelism against stage 3 on the same MoE", "",
                 f"`OMP_NUM_THREADS=1 torchrun --nproc_per_node {world} -m bench.moe_ep_vs_stage3 --steps {args.steps}` "
                 f"({world} gloo ranks on this machine's CPUs, both engines in every process, stepped in turn; "
                 f"{WIDTH}-wide, {EXPERTS} experts x {LAYERS} blocks, top-2, {TOKENS} tokens per rank). "
                 "Written " + time.strftime("%Y-%m-%d %H:%M") + ".", "",
                 "| | median step s | bytes per rank and step, by operation |", "|---|---|---|"]
        for name in engines:
            ops = ", ".join(f"{op} {n / 2**20:.2f} MiB" for op, n in sorted(moved[name].by_op.items()))
            total = sum(moved[name].by_op.values()) / 2**20
            lines.append(f"| {name} | {statistics.median(times[name][i] for i in timed):.4f} | "
                         f"{total:.2f} MiB ({ops}) |")
        q = statistics.quantiles(ratios, n=4)
        lines += ["", f"Median per-step ratio ep2 / stage3: **{statistics.median(ratios):.3f}** (interquartile range "
                  f"{q[0]:.3f}-{q[2]:.3f}, over {len(ratios)} steps)."]
        Path(args.results).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
