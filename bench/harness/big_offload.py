"""A GPT larger than this machine's memory, trained at stage 3 with NVMe offload of optimizer and parameters.

    torchrun --nproc_per_node 2 -m bench.harness.big_offload --nvme-path /path/on/a/fast/disk --size 3b --steps 3
    make bench-offload NVME=/path/on/a/fast/disk            (the same, 3b, 3 steps)
    torchrun --nproc_per_node 2 -m bench.harness.big_offload --nvme-path /tmp --size 80m --steps 2   (a check)

Not part of the test suite. The model is built under `zerodp.init_context` with `offload_param` nvme,
so no rank ever holds it: each parameter's 1/N slice goes to its file as it is made. Every optimizer
step prints, on each rank, the step's wall time split into
    compute    forward and backward arithmetic (and the gradient reduce-scatters)
    gathers    time blocked on parameter all-gathers
    nvme_read  time blocked on reads (parameter shards, optimizer state)
    nvme_write time blocked on writes
    optimizer  the CPU optimizer step itself (its I/O waits are in nvme_*)
and at the end the loss curve, peak RSS per rank (getrusage: the true high-water mark), bytes on disk
and bytes read and written, and the floor of one step on this machine: the larger of
    compute  6 x parameters x tokens per rank FLOPs at the fp32 matmul rate measured here at start-up
    NVMe     the bytes both ranks read and wrote in the last step (they share one disk) at the
             bandwidths given by --disk-read-gbps / --disk-write-gbps (defaults: zerodp's FileIO with
             2 threads on this machine's disk, bench/results/offload_io.txt) Sizes (fp32: model states are 16 bytes per parameter):
    3b   vocab 32000, 37 layers, width 2560: 3.07e9 parameters, 49 GB of model states
    80m  vocab 8192, 10 layers, width 768:  8.3e7 parameters (the end-to-end check)
What stays in memory per rank: the gathered working set (the root unit with the embeddings, one or two
blocks, and a unit's full gradient buffer until its reduction), max_in_cpu cached elements of the
parameter shards and as many of the gradient shards (in fp32 these live in nvme_path too: [Note:
gradient shards offloaded] in offload/shard_store.py), and buffer_count optimizer windows of
sub_group_size elements.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp

from zerodp import comm
from zerodp.tools.models.gpt import GPT, GPTConfig
from .models import synthetic_tokens

SIZES = {
    "3b": GPTConfig(vocab_size=32000, block_size=128, n_layer=37, n_head=20, n_embd=2560, tie_embeddings=False),
    "80m": GPTConfig(vocab_size=8192, block_size=128, n_layer=10, n_head=12, n_embd=768, tie_embeddings=False),
    # the 3b's blocks and vocabulary, 4 of them: a step in under a minute with the 3b's per-unit behaviour
    "500m": GPTConfig(vocab_size=32000, block_size=128, n_layer=4, n_head=20, n_embd=2560, tie_embeddings=False),
}


def make_config(nvme_path: str, micro_batch: int, block_numel: int) -> dict:
    """Stage 3, fp32, both offloads on nvme; the cache holds two blocks' shards, the optimizer streams
    windows of 1e7 elements."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_clipping": 1.0,
        "aio": {"thread_count": 2},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 10_000_000, "stage3_param_persistence_threshold": 100_000,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3},
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4,
                              "max_in_cpu": 2 * block_numel, "buffer_size": 400_000_000},
        },
    }


def io_waits(engine) -> tuple[float, float]:
    """Seconds blocked on NVMe reads and writes so far (parameter and gradient shards, optimizer state)."""
    read = write = 0.0
    for part in (engine.sharding.param_home, engine.sharding.grad_home, engine.optimizer.offload):
        if part is not None:
            read, write = read + part.read_wait_s, write + part.write_wait_s
    return read, write


def io_bytes(engine) -> tuple[int, int, int]:
    """(bytes on disk, bytes read, bytes written) of this rank so far (the gradient store shares the
    parameter store's I/O pool, so its bytes are counted there)."""
    home, grads, state = engine.sharding.param_home, engine.sharding.grad_home, engine.optimizer.offload
    disk = home.disk_bytes() + state.disk_bytes() + (grads.disk_bytes() if grads else 0)
    read = home.read_bytes + state.owned[0].read_bytes
    written = home.written_bytes + state.owned[0].written_bytes
    return disk, read, written


def _peak_rss() -> int:
    """This process's RSS high-water mark in bytes (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fixed_mmap_threshold() -> None:
    """Serve every allocation over 128 KiB by mmap, returned to the OS when freed. glibc otherwise raises
    its mmap threshold after the first large free, and the shards freed and re-read every step then stay
    in the heap: the RSS high-water mark would count memory zerodp no longer holds (1.54 GiB instead of
    0.99 GiB per rank at 80m, measured)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def matmul_flops() -> float:
    """FLOP/s of a block-sized fp32 matmul on one thread here (the compute part of the floor)."""
    a, b = torch.randn(512, 2560), torch.randn(2560, 2560)
    torch.mm(a, b)
    start, reps = time.perf_counter(), 8
    for _ in range(reps):
        torch.mm(a, b)
    return reps * 2 * 512 * 2560 * 2560 / (time.perf_counter() - start)


def floor_line(numel: int, tokens: int, flops: float, read_bytes: int, written_bytes: int,
               read_gbps: float, write_gbps: float) -> str:
    compute = 6 * numel * tokens / flops
    nvme = read_bytes / (read_gbps * 1e9) + written_bytes / (write_gbps * 1e9)
    return (f"floor per step: {max(compute, nvme):.1f}s = max(compute {compute:.1f}s: 6 x {numel / 1e9:.2f}e9 x "
            f"{tokens} tokens at {flops / 1e9:.1f} GFLOP/s, NVMe {nvme:.1f}s: {read_bytes / 1e9:.1f} GB read at "
            f"{read_gbps} GB/s + {written_bytes / 1e9:.1f} GB written at {write_gbps} GB/s by both ranks)")


def main(argv=None) -> None:
    _fixed_mmap_threshold()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", required=True, help="directory on a fast local disk for the offload files")
    parser.add_argument("--size", choices=sorted(SIZES), default="3b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", help="also write the per-rank results as JSON lines to this file (rank 0 appends)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (weight decay 0.01)")
    parser.add_argument("--data", choices=("fixed", "stream"), default="fixed",
                        help="fixed: the same micro-batch every step, so a working step must lower the loss "
                             "(a few steps of a fresh stream mostly measure the batches' differences)")
    parser.add_argument("--disk-read-gbps", type=float, default=1.65, help="disk read bandwidth for the floor")
    parser.add_argument("--disk-write-gbps", type=float, default=1.9, help="disk write bandwidth for the floor")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gpt = SIZES[args.size]
    block_numel = 12 * gpt.n_embd ** 2 + 13 * gpt.n_embd
    cfg = make_config(args.nvme_path, args.micro_batch, block_numel)
    comm.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    flops = matmul_flops()
    start = time.perf_counter()
    with zerodp.init_context(cfg):
        model = GPT(gpt, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    # fused: torch's fastest CPU AdamW (bench/results/cpu_adam.md); zerodp steps exactly the user's optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    engine = zerodp.initialize(model, optimizer, cfg)
    build_s = time.perf_counter() - start
    if rank == 0:
        print(f"{args.size}: {numel / 1e9:.3f}e9 parameters, fp32 model states {16 * numel / 1e9:.1f} GB, "
              f"{world} ranks; built in {build_s:.1f}s, peak RSS so far {_peak_rss() / 2**30:.2f} GiB", flush=True)
    losses, steps = [], []
    for step in range(args.steps):
        tokens = synthetic_tokens(0 if args.data == "fixed" else step, rank, args.micro_batch, args.seq_len,
                                  gpt.vocab_size)
        read0, write0 = io_waits(engine)
        bytes0 = io_bytes(engine)
        gather0 = engine.sharding.shards.gather_wait_s
        t0 = time.perf_counter()
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, gpt.vocab_size), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        t1 = time.perf_counter()
        read1, write1 = io_waits(engine)
        engine.step()
        t2 = time.perf_counter()
        read2, write2 = io_waits(engine)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        gather_s = engine.sharding.shards.gather_wait_s - gather0
        split = {"total": t2 - t0, "compute": (t1 - t0) - gather_s - (read1 - read0) - (write1 - write0),
                 "gathers": gather_s, "nvme_read": read2 - read0, "nvme_write": write2 - write0,
                 "optimizer": (t2 - t1) - (read2 - read1) - (write2 - write1)}
        split["read_gb"], split["written_gb"] = [(b - a) / 1e9 for a, b in zip(bytes0[1:], io_bytes(engine)[1:])]
        steps.append(split)
        print(f"rank {rank} step {step}: loss {losses[-1]:.4f} " + " ".join(f"{k}={v:.2f}s" for k, v in split.items() if not k.endswith("_gb"))
              + f" read {split['read_gb']:.1f} GB written {split['written_gb']:.1f} GB"
              + f" peak RSS {_peak_rss() / 2**30:.2f} GiB", flush=True)
    disk, read, written = io_bytes(engine)
    result = {"rank": rank, "world": world, "size": args.size, "params": numel, "losses": losses, "steps": steps,
              "peak_rss_bytes": _peak_rss(), "disk_bytes": disk,
              "read_bytes": read, "written_bytes": written, "build_s": build_s,
              "memory_report": engine.memory_report().as_dict()}
    results = [None] * world
    dist.all_gather_object(results, result)
    engine.close()  # the files go; so does the process group, which zerodp created (comm.init_distributed)
    if rank == 0:
        for r in results:
            print(f"rank {r['rank']}: peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, disk {r['disk_bytes'] / 1e9:.2f} GB, "
                  f"read {r['read_bytes'] / 1e9:.2f} GB, written {r['written_bytes'] / 1e9:.2f} GB")
        print(f"losses: {' '.join(f'{x:.4f}' for x in losses)}", flush=True)
        last = [r["steps"][-1] for r in results]
        print(floor_line(numel, args.micro_batch * args.seq_len, flops, int(sum(s["read_gb"] for s in last) * 1e9),
                         int(sum(s["written_gb"] for s in last) * 1e9), args.disk_read_gbps, args.disk_write_gbps),
              flush=True)
        if args.out:
            with open(args.out, "a") as f:
                for r in results:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
