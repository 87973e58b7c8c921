"""The error bf16 gradient reduction and accumulation leave, against an fp64 reference (issue 20):

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python bench/bf16_reduction_error.py --out docs/precision.md

Real gradients: zerodp train's GPT (small preset) in bf16 on its embedded corpus, one bf16 backward per
(rank, micro-step) for 8 ranks x 16 micro-steps, micro-batch 2 x 128 tokens. For N ranks and A micro-steps
the reference is their mean in fp64. Each mode replays what stages 2-3 do with zerodp's own arithmetic
(`grads.grad_arithmetic.GradArithmetic`): every micro-step, each rank's gradient is cast to the
communication dtype (`communication_data_type`), the ranks' values are summed in that dtype (rank by rank:
each partial sum rounded, as a ring's or a pairwise exchange's additions are; the order differs from a real
collective's, the number of roundings does not), divided by N, cast to the accumulation dtype
(`data_types.grad_accum_dtype`) and added to the accumulated gradient. Reported: ||g - g_ref|| / ||g_ref||.
"""

from __future__ import annotations

import argparse

import torch

from zerodp.tools.app.corpus import ByteCorpus
from zerodp.tools.models.gpt import GPT, MODEL_PRESETS, lm_loss
from zerodp.shard.grads.grad_arithmetic import GradArithmetic

MODES = {  # name -> (communication dtype, accumulation dtype)
    "bf16 reduce, bf16 accumulate (default)": (torch.bfloat16, torch.bfloat16),
    "fp32 reduce, bf16 accumulate": (torch.float32, torch.bfloat16),
    "bf16 reduce, fp32 accumulate": (torch.bfloat16, torch.float32),
    "fp32 reduce, fp32 accumulate": (torch.float32, torch.float32),
}


def reduced_gradient(grads: list[list[torch.Tensor]], comm_dtype: torch.dtype, accum_dtype: torch.dtype) -> torch.Tensor:
    """`grads[m][r]`: rank r's bf16 gradient at micro-step m. The averaged gradient stages 2-3 end with."""
    world = len(grads[0])
    arithmetic = GradArithmetic(world, accum_dtype=accum_dtype, comm_dtype=comm_dtype)
    acc = torch.zeros_like(grads[0][0], dtype=accum_dtype)
    for per_rank in grads:
        sent = [arithmetic.to_send(g.clone(), comm_dtype) for g in per_rank]
        total = sent[0].clone()
        for s in sent[1:]:
            total += s  # rounded to the communication dtype after every addition
        acc += arithmetic.finish(total).to(accum_dtype)
    return acc


def relative_error(grads: list[list[torch.Tensor]], comm_dtype, accum_dtype) -> float:
    reference = torch.stack([g.double() for per_rank in grads for g in per_rank]).sum(0) / len(grads[0])
    got = reduced_gradient(grads, comm_dtype, accum_dtype).double()
    return ((got - reference).norm() / reference.norm()).item()


def bf16_gradients(ranks: int, micro_steps: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["small"], seed=0).to(torch.bfloat16)
    corpus = ByteCorpus.from_stdlib()
    out = []
    for m in range(micro_steps):
        per_rank = []
        for r in range(ranks):
            x, y = corpus.batch(m, r, ranks, 2, 128)
            model.zero_grad()
            (lm_loss(model(x), y) / micro_steps).backward()  # the engine's 1/A scale, before the rank average
            per_rank.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        out.append(per_rank)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    ns = parser.parse_args(argv)
    grads = bf16_gradients(max(ns.world), max(ns.accumulation))
    lines = ["| ranks | micro-steps | " + " | ".join(MODES) + " |", "|---|---|" + "---|" * len(MODES)]
    for world in ns.world:
        for accumulation in ns.accumulation:
            subset = [per_rank[:world] for per_rank in grads[:accumulation]]
            errors = [relative_error(subset, c, a) for c, a in MODES.values()]
            lines.append(f"| {world} | {accumulation} | " + " | ".join(f"{e:.2e}" for e in errors) + " |")
            print(lines[-1], flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
