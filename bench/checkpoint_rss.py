"""Issue 21 item 2: peak RSS of save_checkpoint and load_checkpoint (fresh process) against training's.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python bench/checkpoint_rss.py [both|none]
    (env: D=layers (24) W=width (2048) STEPS=n before the save (2) MORE=n after it (2) DIR=work folder;
     SG=sub_group_size MIC=max_in_cpu: set them to see a smaller training peak; unset, a user's config)

An MLP of D x Linear(W, W) (24 x 2048^2: 100.7M parameters), built under zerodp.init_context, fp32
AdamW, stage 3 on 2 gloo ranks; `both`: offload_param and offload_optimizer on nvme with only device
and nvme_path set (a user's config). Two phases, each in fresh processes (torch.multiprocessing spawn):
  train:  build, initialize, STEPS steps, save_checkpoint, MORE steps (the uninterrupted losses)
  resume: build, initialize, load_checkpoint, MORE steps (the resumed losses)
Memory is what the OS sees, no malloc_trim anywhere: `ru_maxrss` (the process's peak RSS so far) at
each point, and VmHWM after `/proc/self/clear_refs 5` reset it just before the save or the load
(the peak of that call alone). Printed in GiB per rank.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

MODE = sys.argv[1] if len(sys.argv) > 1 else "both"
WIDTH, DEPTH = int(os.environ.get("W", 2048)), int(os.environ.get("D", 24))
STEPS, MORE, MICRO_BS = int(os.environ.get("STEPS", 2)), int(os.environ.get("MORE", 2)), 4
GiB = 2**30


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def config(nvme: str) -> dict:
    zero = {"stage": 3}
    if MODE == "both":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        if "MIC" in os.environ:
            zero["offload_param"]["max_in_cpu"] = int(float(os.environ["MIC"]))
    if "SG" in os.environ:
        zero["sub_group_size"] = int(float(os.environ["SG"]))
    return {"train_micro_batch_size_per_gpu": MICRO_BS, "zero_optimization": zero}


def steps(engine, first: int, n: int) -> list[float]:
    losses = []
    for s in range(first, first + n):
        g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        x = torch.randn(MICRO_BS, WIDTH, generator=g)
        loss = F.mse_loss(engine(x), x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def worker(rank: int, phase: str, work: str, out: dict) -> None:
    import zerodp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/rdzv-{phase}", rank=rank, world_size=2)
    cfg = config(f"{work}/nvme")
    rec = {"start": maxrss()}
    t0 = time.time()
    with zerodp.init_context(cfg):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    rec["initialized"] = maxrss()
    if phase == "train":
        steps(engine, 0, STEPS)
        rec["trained"] = maxrss()
        rec["rss_before"] = vm("VmRSS")
        reset_hwm()
        t = time.time()
        engine.save_checkpoint(f"{work}/ckpt", tag="t")
        rec["save_s"] = time.time() - t
        rec["save_hwm"], rec["saved"] = vm("VmHWM"), maxrss()
        rec["losses"] = steps(engine, STEPS, MORE)
    else:
        rec["rss_before"] = vm("VmRSS")
        reset_hwm()
        t = time.time()
        engine.load_checkpoint(f"{work}/ckpt", tag="t")
        rec["load_s"] = time.time() - t
        rec["load_hwm"], rec["loaded"] = vm("VmHWM"), maxrss()
        rec["after_load_anon_file"] = (vm("RssAnon"), vm("RssFile"))
        rec["losses"] = steps(engine, STEPS, MORE)
    rec["total_s"] = time.time() - t0
    engine.close()
    dist.barrier()
    with open(f"{work}/{phase}-{rank}.json", "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


def main() -> None:
    work = os.environ.get("DIR") or tempfile.mkdtemp(prefix="ckpt_rss_")
    os.makedirs(f"{work}/nvme", exist_ok=True)
    for phase in ("train", "resume"):
        mp.spawn(worker, args=(phase, work, {}), nprocs=2, join=True)
    print(f"mode={MODE} SG={os.environ.get('SG', 'unset')} MIC={os.environ.get('MIC', 'unset')} "
          f"{DEPTH} x Linear({WIDTH}, {WIDTH}), {DEPTH * (WIDTH * WIDTH + WIDTH) / 1e6:.1f}M params")
    for rank in range(2):
        tr = json.load(open(f"{work}/train-{rank}.json"))
        rs = json.load(open(f"{work}/resume-{rank}.json"))
        g = lambda v: f"{v / GiB:.2f}"
        print(f"rank {rank}: train: start {g(tr['start'])} init {g(tr['initialized'])} trained(peak) "
              f"{g(tr['trained'])} | RSS before save {g(tr['rss_before'])} save alone {g(tr['save_hwm'])} "
              f"maxrss after save {g(tr['saved'])} "
              f"({tr['save_s']:.1f} s) || resume: start {g(rs['start'])} init {g(rs['initialized'])} | RSS before load "
              f"{g(rs['rss_before'])} load alone "
              f"{g(rs['load_hwm'])} maxrss after load {g(rs['loaded'])} ({rs['load_s']:.1f} s) || "
              f"save/train {tr['saved'] / tr['trained']:.2f} load/train {rs['loaded'] / tr['trained']:.2f}")
        print(f"   right after the load: RssAnon {g(rs['after_load_anon_file'][0])} RssFile "
              f"{g(rs['after_load_anon_file'][1])} GiB (file-backed pages count as RSS while mapped)")
        print(f"   losses uninterrupted {tr['losses']} resumed {rs['losses']} equal={tr['losses'] == rs['losses']}")
    print(f"work dir {work}")


if __name__ == "__main__":
    main()
