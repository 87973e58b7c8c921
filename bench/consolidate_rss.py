"""Issue 21 item 3: peak RSS of `zerodp consolidate`, whole-model (before) against streaming (after).

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python bench/consolidate_rss.py
    (env: D=layers (24) W=width (2048) V=vocab rows of the embedding (32000) DIR=work folder
     OLD_SRC=a zerodp source tree with the old consolidate (default /work/main/src) to measure "before")

The checkpoint: Embedding(V, W) (the largest tensor: 32000 x 2048 fp32 = 250 MiB) then D x
Linear(W, W, bias=False), 166.2M parameters, built under zerodp.init_context, saved at stage 3 by 2 gloo
ranks right after initialize (plain SGD: the rank files hold the fp32 masters only, 2 x 317 MiB), so
each tensor is split across both rank files. Each consolidation runs in a fresh process; its peak RSS
is the kernel's `ru_maxrss` for that child (os.wait4), no malloc_trim anywhere. The baseline is a
process that imports zerodp's CLI and checkpoint packages (torch included) and exits: what any
`zerodp consolidate` costs before reading a byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WIDTH, DEPTH, VOCAB = int(os.environ.get("W", 2048)), int(os.environ.get("D", 24)), int(os.environ.get("V", 32000))
OLD_SRC = os.environ.get("OLD_SRC", "/work/main/src")
NEW_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
MiB = 2**20


def build(rank: int, work: str) -> None:
    import zerodp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/rdzv", rank=rank, world_size=2)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with zerodp.init_context(cfg):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), *[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3), cfg)
    engine.save_checkpoint(f"{work}/ckpt", tag="t")
    engine.close()
    dist.destroy_process_group()


def peak_rss(args: list[str], src: str) -> tuple[int, float]:
    """(ru_maxrss in bytes, seconds) of `python args...` run with zerodp from `src`."""
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    t = time.time()
    proc = subprocess.Popen([sys.executable] + args, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{args} failed ({status})")
    return usage.ru_maxrss * 1024, time.time() - t  # KiB on Linux


def main() -> None:
    work = os.environ.get("DIR") or tempfile.mkdtemp(prefix="consolidate_rss_")
    if not os.path.isdir(f"{work}/ckpt"):
        mp.spawn(build, args=(work,), nprocs=2, join=True)
    numel = VOCAB * WIDTH + DEPTH * WIDTH * WIDTH
    largest = VOCAB * WIDTH * 4
    ckpt_bytes = sum(os.path.getsize(os.path.join(f"{work}/ckpt/t", f)) for f in os.listdir(f"{work}/ckpt/t"))
    print(f"model: Embedding({VOCAB}, {WIDTH}) + {DEPTH} x Linear({WIDTH}, {WIDTH}): {numel / 1e6:.1f}M parameters, "
          f"{numel * 4 / MiB:.0f} MiB fp32; largest tensor {largest / MiB:.0f} MiB; checkpoint {ckpt_bytes / MiB:.0f} MiB")
    base, _ = peak_rss(["-c", "import zerodp.tools.cli.main, zerodp.checkpoint"], NEW_SRC)
    print(f"baseline (python + import zerodp, torch): {base / MiB:.0f} MiB")
    cases = [("before: whole state dict, then one file", OLD_SRC, [f"{work}/out-old.safetensors"]),
             ("after: folder, default 5GB shards (1 file)", NEW_SRC, [f"{work}/hf-one"]),
             ("after: folder, --max-shard-size 100MB", NEW_SRC, [f"{work}/hf-sharded", "--max-shard-size", "100MB"]),
             ("after: one *.safetensors file", NEW_SRC, [f"{work}/out-new.safetensors"]),
             ("after: *.pt (torch.save, whole dict)", NEW_SRC, [f"{work}/out.pt"])]
    print(f"| run | peak RSS MiB | minus baseline MiB | / largest tensor | / model | s |\n|---|---|---|---|---|---|")
    for label, src, out in cases:
        rss, seconds = peak_rss(["-m", "zerodp", "consolidate", f"{work}/ckpt"] + out, src)
        print(f"| {label} | {rss / MiB:.0f} | {(rss - base) / MiB:.0f} | {(rss - base) / largest:.2f} | "
              f"{(rss - base) / (numel * 4):.2f} | {seconds:.1f} |")
    print(f"work folder: {work}")


if __name__ == "__main__":
    main()
