"""The big offloaded GPT saves a checkpoint, resumes from it in a fresh process and continues with the losses
of an uninterrupted run; peak RSS of the save and of the load against training's (issue 21).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/big_checkpoint.py train  --size 1b5 --nvme-path N --ckpt C
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/big_checkpoint.py resume --size 1b5 --nvme-path N --ckpt C
    /usr/bin/time -v zerodp consolidate C OUT_FOLDER      (streaming, Hugging Face layout; its peak RSS)

The 3b (whose offload files, 49 GB, and checkpoint, ~35 GB, this machine's disk cannot hold together with the
gradient files full) runs the uninterrupted reference as its own launch, saves with --after 0, and resumes
with --delete-after-load (the checkpoint goes once loaded, before the gradient files take their space back):
    ... big_checkpoint.py uninterrupted --size 3b --before 1 --after 2 --nvme-path N --ckpt C
    ... big_checkpoint.py train --size 3b --before 1 --after 0 --nvme-path N --ckpt C
    ... big_checkpoint.py resume --size 3b --before 1 --after 2 --nvme-path N --ckpt C --delete-after-load

train:  build under init_context (both offloads on nvme, big_offload's settings), --before steps, save, --after
        steps (the uninterrupted losses, written to C/train.json)
uninterrupted: build, --before + --after steps, no checkpoint (C/uninterrupted.json); resume compares with it
        when it is there
resume: build, load, --after steps; prints its losses next to the uninterrupted ones and whether they are equal
Memory is what the OS sees (no malloc_trim): ru_maxrss before and after each phase's save or load, and the
VmHWM of the save / load alone (reset through /proc/self/clear_refs just before it). Results:
bench/results/big_checkpoint.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import zerodp  # noqa: E402
from zerodp import comm  # noqa: E402
from zerodp.tools.models.gpt import GPT, GPTConfig  # noqa: E402

from bench.harness.big_offload import SIZES, _fixed_mmap_threshold, make_config  # noqa: E402
from bench.harness.models import synthetic_tokens  # noqa: E402

# 1.5e9 parameters: the size whose swap files (24 GB) and checkpoint (18 GB) fit this machine's disk together
BIG = {**SIZES, "1b5": GPTConfig(vocab_size=32000, block_size=128, n_layer=17, n_head=20, n_embd=2560,
                                 tie_embeddings=False)}
GiB = 2**30


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_steps(engine, gpt: GPTConfig, first: int, n: int, rank: int) -> list[float]:
    losses = []
    for step in range(first, first + n):
        tokens = synthetic_tokens(step, rank, 1, 128, gpt.vocab_size)  # a new batch each step
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, gpt.vocab_size), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f} peak RSS {maxrss() / GiB:.2f} GiB", flush=True)
    return losses


def main() -> None:
    _fixed_mmap_threshold()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("train", "resume", "uninterrupted"))
    parser.add_argument("--size", choices=sorted(BIG), default="1b5")
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--before", type=int, default=2)
    parser.add_argument("--after", type=int, default=2)
    parser.add_argument("--delete-after-load", action="store_true",
                        help="resume: remove the checkpoint folder once it is loaded (disk space for the 3b)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gpt = BIG[args.size]
    cfg = make_config(args.nvme_path, 1, 12 * gpt.n_embd ** 2 + 13 * gpt.n_embd)
    comm.init_distributed()
    rank = dist.get_rank()
    t0 = time.perf_counter()
    with zerodp.init_context(cfg):
        model = GPT(gpt, seed=0)
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True), cfg)
    out = {"rank": rank, "size": args.size, "params": sum(p.numel() for p in model.parameters()),
           "build_s": time.perf_counter() - t0}
    if args.phase == "uninterrupted":
        os.makedirs(args.ckpt, exist_ok=True)
        losses = run_steps(engine, gpt, 0, args.before + args.after, rank)
        out["losses_before"], out["losses_after"] = losses[:args.before], losses[args.before:]
        out["training_peak"] = maxrss()
    elif args.phase == "train":
        out["losses_before"] = run_steps(engine, gpt, 0, args.before, rank)
        out["training_peak"] = maxrss()
        reset_hwm()
        t0 = time.perf_counter()
        engine.save_checkpoint(args.ckpt, tag="big")
        out["save_s"], out["save_hwm"], out["peak_after_save"] = time.perf_counter() - t0, hwm(), maxrss()
        out["losses_after"] = run_steps(engine, gpt, args.before, args.after, rank)
    else:
        out["peak_before_load"] = maxrss()
        reset_hwm()
        t0 = time.perf_counter()
        engine.load_checkpoint(args.ckpt, tag="big")
        out["load_s"], out["load_hwm"], out["peak_after_load"] = time.perf_counter() - t0, hwm(), maxrss()
        if args.delete_after_load:
            dist.barrier()
            if rank == 0:
                for name in os.listdir(args.ckpt):
                    if name not in ("train.json", "uninterrupted.json"):
                        shutil.rmtree(os.path.join(args.ckpt, name), ignore_errors=True)
                        if os.path.isfile(os.path.join(args.ckpt, name)):
                            os.remove(os.path.join(args.ckpt, name))
            dist.barrier()
        out["losses_after"] = run_steps(engine, gpt, args.before, args.after, rank)
        out["peak"] = maxrss()
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, out)
    engine.close()
    if rank == 0:
        path = os.path.join(args.ckpt, f"{args.phase}.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        if args.phase == "resume":
            reference = os.path.join(args.ckpt, "uninterrupted.json")
            if not os.path.exists(reference):
                reference = os.path.join(args.ckpt, "train.json")
            with open(reference) as f:
                first = json.load(f)[0]["losses_after"]
            print(f"uninterrupted {first}\nresumed       {results[0]['losses_after']}\n"
                  f"equal: {first == results[0]['losses_after']}")
        for r in results:
            print(json.dumps({k: (round(v / GiB, 3) if ("peak" in k or "hwm" in k) else v) for k, v in r.items()}))


if __name__ == "__main__":
    main()
