"""One benchmark run: one strategy, N ranks under torchrun, a GPT on synthetic tokens; writes JSON.

The model and settings are those of shared/research/baselines.md (vocab 8192, 8 layers, hidden 512,
8 heads, sequence 128, untied head: 33.7M parameters; AdamW lr 1e-3 wd 0.01; micro-batch 4 per rank;
fp32; OMP_NUM_THREADS=1), so numbers are comparable with the peers measured there.

    torchrun --standalone --nproc_per_node 2 bench/bench.py --strategy zerodp2 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategies import STRATEGIES  # noqa: E402

from zerodp.examples.gpt import GPT, GPTConfig  # noqa: E402

BENCH_MODELS = {
    "baseline": GPTConfig(vocab_size=8192, block_size=128, n_layer=8, n_head=8, n_embd=512, tie_embeddings=False),
    "tiny": GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, tie_embeddings=False),
}


def synthetic_tokens(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """A learnable stream: each token follows a fixed successor of the previous one half of the time."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    succ = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
    noise = torch.randint(vocab, (batch, seq), generator=g)
    keep = torch.rand(batch, seq, generator=g) < 0.5
    for t in range(seq):
        tokens[:, t + 1] = torch.where(keep[:, t], succ[tokens[:, t]], noise[:, t])
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", required=True, choices=sorted(STRATEGIES))
    ap.add_argument("--model", default="baseline", choices=sorted(BENCH_MODELS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = BENCH_MODELS[args.model]
    torch.manual_seed(0)
    model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    runner = STRATEGIES[args.strategy](model)
    losses, times = [], []
    for step in range(args.steps):
        tokens = synthetic_tokens(step, rank, args.micro_batch, cfg.block_size, cfg.vocab_size)
        dist.barrier()
        t0 = time.perf_counter()
        logits = runner.forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        runner.backward(loss)
        runner.step()
        times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    result = {
        "strategy": args.strategy, "model": args.model, "world_size": world, "rank": rank,
        "params": numel, "losses": losses, "step_times": times,
        "model_state_bytes": runner.model_state_bytes(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch": torch.__version__, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    del runner, model  # DDP's reducer must go before its process group, or gloo aborts at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
