"""The error ZeRO++'s quantized collectives leave, step by step, on the real weights and gradients of
`zerodp train`'s GPT (small preset, its data and AdamW, one process):

    .venv/bin/python bench/quantized_error.py --steps 200 --world 2 8

At chosen steps, with N simulated ranks:
- qwZ: each rank's shard of every flat parameter unit (the model's parameters in order, padded to N
  equal shards as stage 3 lays them out) quantized to int8 in blocks of 256 and dequantized:
  relative error ||W_q - W|| / ||W||, and the largest element error relative to max|W|;
- qgZ: N gradients (one per rank: the global batch split in N micro-batches), each cut into N
  destination slices, quantized to int4 in blocks of 256, dequantized and summed in rank order,
  as comm/quantized.py does: relative error of the reduced gradient ||g_q - g|| / ||g||.
The arithmetic is comm/quantize.py's own; only the collective is simulated (it moves the same bytes).
Results go to docs/quantized.md by hand. Not part of the test suite.
"""

from __future__ import annotations

import argparse

import torch

from zerodp.comm.quantize import dequantize, quantize
from zerodp.comm.quantized import BLOCK_NUMEL
from zerodp.tools.app.corpus import ByteCorpus
from zerodp.tools.models.gpt import GPT, MODEL_PRESETS, lm_loss


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _shards(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    shard = -(-flat.numel() // world)
    padded = torch.zeros(shard * world)
    padded[:flat.numel()] = flat
    return list(padded.view(world, shard))


def weight_error(params, world: int) -> tuple[float, float]:
    flat = _flat(params)
    back = torch.cat([dequantize(quantize(s, 8, BLOCK_NUMEL), s.numel(), 8, BLOCK_NUMEL) for s in _shards(flat, world)])
    diff = back[:flat.numel()] - flat
    return (diff.norm() / flat.norm()).item(), (diff.abs().max() / flat.abs().max()).item()


def gradient_error(rank_grads: list[torch.Tensor], world: int) -> float:
    exact = torch.stack(rank_grads).sum(0)
    total = torch.zeros_like(exact)
    for g in rank_grads:  # every rank quantizes each destination slice of its gradient
        for dst, part in enumerate(_shards(g, world)):
            lo = dst * part.numel()
            hi = min(lo + part.numel(), exact.numel())
            total[lo:hi] += dequantize(quantize(part, 4, BLOCK_NUMEL), part.numel(), 4, BLOCK_NUMEL)[:hi - lo]
    return ((total - exact).norm() / exact.norm()).item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--at", type=int, nargs="+", default=[1, 10, 50, 100, 200])
    ns = parser.parse_args(argv)
    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["small"], seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    corpus, micro, seq = ByteCorpus.from_stdlib(), 2, 128
    biggest = max(ns.world)
    print(f"| step | world | qwZ weight rel. error (norm) | qwZ max element error / max abs | "
          f"qgZ reduced-gradient rel. error (norm) |")
    print("|---|---|---|---|---|")
    for step in range(ns.steps):
        rank_grads = []
        for rank in range(biggest):  # the global batch of `biggest` ranks; fewer ranks sum groups of them
            x, y = corpus.batch(step, rank, biggest, micro, seq)
            opt.zero_grad()
            (lm_loss(model(x), y) / biggest).backward()
            rank_grads.append(_flat(p.grad for p in model.parameters()))
        if step + 1 in ns.at:
            for world in ns.world:
                per = biggest // world
                grads = [torch.stack(rank_grads[r * per:(r + 1) * per]).sum(0) for r in range(world)]
                w_rel, w_max = weight_error(model.parameters(), world)
                print(f"| {step + 1} | {world} | {w_rel:.2e} | {w_max:.2e} | {gradient_error(grads, world):.2e} |",
                      flush=True)
        total = torch.stack(rank_grads).sum(0)
        offset = 0
        for p in model.parameters():
            p.grad = total[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()


if __name__ == "__main__":
    main()
