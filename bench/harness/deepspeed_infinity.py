"""DeepSpeed ZeRO-Infinity on the same GPT and settings as bench.harness.big_offload, for a side-by-side.

    torchrun --nproc_per_node 2 -m bench.harness.deepspeed_infinity --nvme-path DIR --size 80m --steps 3   (a check)
    torchrun --nproc_per_node 2 -m bench.harness.deepspeed_infinity --nvme-path DIR --size 3b --steps 3

Run it in the benchmark's environment (bench/.venv: DeepSpeed 0.19.8, which JIT-compiles its cpu_adam
and async_io ops with ninja on first use; async_io needs the Debian package libaio-dev). Same model
(big_offload.SIZES, built from seed 0 with GPT-2's initialization), same tokens
(models.synthetic_tokens), micro-batch 1, sequence 128, AdamW lr 1e-4 (--lr) weight decay 0.01, one fixed batch (--data), fp32, gradient
clipping 1.0, stage 3 with offload_optimizer and offload_param on nvme; sub_group_size, the persistence
threshold and max_in_cpu as big_offload sets them. DeepSpeed's optimizer for offload is its
DeepSpeedCPUAdam (adamw_mode), or torch's AdamW with --torch-adam.

The model is built under deepspeed.zero.Init(remote_device="nvme"), so no rank holds it whole; GPT's own
reset_parameters then re-draws each parameter from the seed-0 generator while that one parameter is
gathered (rank 0's draw is kept), so the weights are big_offload's. Prints per step: the mean loss over
ranks, the step time (forward, backward, step) and each rank's peak RSS; at the end the losses, and with
--out the per-rank results as JSON lines. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerodp.tools.models.gpt import GPT
from .big_offload import SIZES, _fixed_mmap_threshold, _peak_rss
from .models import synthetic_tokens

WD = 0.01


def make_config(nvme_path: str, micro_batch: int, block_numel: int, largest_numel: int, torch_adam: bool,
                lr: float = 1e-4) -> dict:
    """big_offload's settings in DeepSpeed's keys. buffer_size must hold the largest parameter (the
    embedding or the head); DeepSpeed keeps buffer_count of them, so it is not made larger. Every
    parameter swapped in holds one buffer until released: buffer_count 5 failed at 80m in the second
    step ("AssertionError: Not enough buffers 0 for swapping 1" in partitioned_param_swapper.swap_in),
    so 10, with the live and prefetched parameters bounded to two and one blocks."""
    offload = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": WD, "torch_adam": torch_adam}},
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2, "single_submit": False,
                "overlap_events": True},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 10_000_000, "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 2 * block_numel, "stage3_prefetch_bucket_size": block_numel,
            "offload_optimizer": dict(offload, buffer_count=4),
            "offload_param": dict(offload, buffer_count=10, buffer_size=largest_numel, max_in_cpu=2 * block_numel),
        },
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


class _OneParameterAtATime:
    """What GPT.reset_parameters reads (config, named_parameters), yielding each parameter while it alone
    is gathered; leaving the gather re-partitions it from rank 0's values."""

    def __init__(self, model: GPT) -> None:
        self.config = model.config
        self._model = model

    def named_parameters(self):
        import deepspeed

        for name, param in self._model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                yield name, param


def build_model(gpt, cfg: dict) -> GPT:
    import deepspeed

    # no dtype=: DeepSpeed 0.19.8 (partition_parameters.Init._set_dtype) turns an explicit dtype into bf16 on
    # the CPU accelerator (`dtype or fp16 if is_fp16_supported() else bf16 if is_bf16_supported else fp32`:
    # the method is not called, so truthy); with the config and no dtype it keeps fp32
    with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
        model = GPT(gpt)  # drawn here from the global RNG, on partitioned (empty) tensors: redrawn below
    GPT.reset_parameters(_OneParameterAtATime(model), torch.Generator().manual_seed(0))
    return model


def main(argv=None) -> None:
    _fixed_mmap_threshold()  # as big_offload, so the peak RSS figures mean the same thing
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", required=True, help="directory on a fast local disk for DeepSpeed's swap files")
    parser.add_argument("--size", choices=sorted(SIZES), default="80m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4, help="as big_offload's --lr")
    parser.add_argument("--data", choices=("fixed", "stream"), default="fixed", help="as big_offload's --data")
    parser.add_argument("--torch-adam", action="store_true", help="torch.optim.AdamW instead of DeepSpeedCPUAdam")
    parser.add_argument("--out", help="also write the per-rank results as JSON lines to this file (rank 0 appends)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import deepspeed

    gpt = SIZES[args.size]
    block_numel = 12 * gpt.n_embd ** 2 + 13 * gpt.n_embd
    largest = max(gpt.vocab_size, gpt.block_size, 4 * gpt.n_embd) * gpt.n_embd
    os.makedirs(args.nvme_path, exist_ok=True)
    cfg = make_config(args.nvme_path, args.micro_batch, block_numel, largest, args.torch_adam, args.lr)
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    model = build_model(gpt, cfg)
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    build_s = time.perf_counter() - start
    if rank == 0:
        print(f"deepspeed {deepspeed.__version__} {args.size}: {numel / 1e9:.3f}e9 parameters, {world} ranks; built "
              f"in {build_s:.1f}s, peak RSS so far {_peak_rss() / 2**30:.2f} GiB", flush=True)
    losses, times = [], []
    for step in range(args.steps):
        tokens = synthetic_tokens(0 if args.data == "fixed" else step, rank, args.micro_batch, args.seq_len,
                                  gpt.vocab_size)
        t0 = time.perf_counter()
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, gpt.vocab_size), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        times.append({"total": t2 - t0, "forward_backward": t1 - t0, "step": t2 - t1})
        print(f"rank {rank} step {step}: loss {losses[-1]:.4f} total={t2 - t0:.2f}s forward+backward={t1 - t0:.2f}s "
              f"step={t2 - t1:.2f}s peak RSS {_peak_rss() / 2**30:.2f} GiB", flush=True)
    result = {"rank": rank, "world": world, "size": args.size, "params": numel, "losses": losses, "steps": times,
              "peak_rss_bytes": _peak_rss(), "build_s": build_s, "deepspeed": deepspeed.__version__,
              "optimizer": type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer, "optimizer")
              else type(engine.optimizer).__name__}
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        for r in results:
            print(f"rank {r['rank']}: peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, optimizer {r['optimizer']}")
        print(f"losses: {' '.join(f'{x:.4f}' for x in losses)}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                for r in results:
                    f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
