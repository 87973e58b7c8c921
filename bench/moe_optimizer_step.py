"""The optimizer step of a 64-expert, top-2 MoE: zerodp's (engine.step) against torch AdamW's (foreach) on the
same model in one process (issue 42 part 4: the MoE step must scale with the experts used).

    python -m bench.moe_optimizer_step [--experts 64] [--steps 30] [--stage 2] [--results bench/results/moe_optimizer_step.md]

One process (world 1, gloo), two copies of the same model (tests/dist/moe_common.py's classic MoE, width 128,
one MoE block) fed the same tokens; per step, after both backwards, torch's step and zerodp's are timed back to
back (order alternating). Few tokens per step (16, top-2): most experts are not routed on a given step, and
most of those that are missed an earlier one, so the step exercises both skipping and per-parameter counts.
The figure is the median per-step ratio over the last two thirds; the two models' parameters are compared
at the end (they must match to fp32 rounding: the comparison is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--results", default=str(ROOT / "bench/results/moe_optimizer_step.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import zerodp
    from tests.dist.moe_common import IN, OUT, ClassicMoE

    init = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    torch.manual_seed(0)
    ref = ClassicMoE(width=128, experts=args.experts, layers=1)
    model = ClassicMoE(width=128, experts=args.experts, layers=1)
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True),
                               {"zero_optimization": {"stage": args.stage}})
    t_torch, t_zerodp = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(args.tokens, IN, generator=g), torch.randn(args.tokens, OUT, generator=g)
        F.mse_loss(ref(x), y).backward()
        engine.backward(F.mse_loss(engine(x), y))
        for which in (("torch", "zerodp") if step % 2 == 0 else ("zerodp", "torch")):
            t0 = time.perf_counter()
            if which == "torch":
                opt.step()
                opt.zero_grad()
                t_torch.append(time.perf_counter() - t0)
            else:
                engine.step()
                t_zerodp.append(time.perf_counter() - t0)
    timed = range(args.steps // 3, args.steps)
    ratio = statistics.median(t_zerodp[i] / t_torch[i] for i in timed)
    worst = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    q = statistics.quantiles([t_zerodp[i] / t_torch[i] for i in timed], n=4)
    command = "python -m bench.moe_optimizer_step " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# MoE optimizer step: zerodp vs torch AdamW (foreach)\n\n`{command}`: {args.experts} experts, top-2, "
            f"width 128, {args.tokens} tokens per step, stage {args.stage}, 1 process, {args.steps} steps (the last "
            f"two thirds timed), {os.cpu_count()} CPUs, shared machine.\n\n"
            f"| | median step ms |\n|---|---|\n| torch AdamW foreach | {1e3 * statistics.median(t_torch[i] for i in timed):.2f} |\n"
            f"| zerodp engine.step | {1e3 * statistics.median(t_zerodp[i] for i in timed):.2f} |\n\n"
            f"Median per-step ratio zerodp / torch: **{ratio:.3f}** (interquartile range {q[0]:.3f}-{q[2]:.3f}). "
            f"Largest parameter difference from torch at the end: {worst:.2e}.\n")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(text)
    print(text)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
