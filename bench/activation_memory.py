"""Peak activation bytes per rank of one forward + backward, with activation checkpointing off, on,
+cpu_checkpointing, +partition_activations and +both, against plan/activation_memory.py's formulas.

    torchrun --standalone --nproc_per_node 2 bench/activation_memory.py --model small --micro-batch 8
    torchrun --standalone --nproc_per_node 2 bench/activation_memory.py --tp-model ...   # zerodp.tools.models.tp_gpt
    python bench/activation_memory.py --device cuda                                      # one GPU: no Pa rows

The ranks form the model-parallel group that Pa partitions across. With the bundled (data-parallel) GPT,
every rank runs the same batch, as the ranks of a tensor-parallel group all hold the same residual stream
(the block inputs that are checkpointed); its blocks are not split. With `--tp-model` the model is the
tensor-parallel GPT over those ranks (the blocks split too).

Measured per setting, after one warm-up step (gradients already allocated, so backward only adds to them):
  - peak: on a CPU device, allocated heap bytes (glibc mallinfo2: `bench.harness.live_memory.in_use_bytes`)
    read after every operator of the step (a dispatch mode, forward and backward) less the bytes before it;
    on CUDA, `torch.cuda.max_memory_allocated()` less the allocated bytes before the step;
  - kept: the bytes the checkpointer holds for backward, by place (device / host), at their peak ("-" when
    nothing is checkpointed: the formula's figure is then every saved activation).
The formula's peak leaves out backward's own temporaries (the gradients of activations), so the measured
peak is a few MiB above it.
On a CPU device host memory is the device's memory: cpu_checkpointing moves the kept bytes to a
separate host buffer (the "kept host" column) but cannot lower the measured peak; on CUDA it does.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness.live_memory import in_use_bytes
from zerodp.activations import DEVICE, HOST, Checkpointer, ModelParallelGroup, RNGStatesTracker
from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig as Settings
from zerodp.tools.plan import format_bytes
from zerodp.tools.plan.activation_memory import activation_memory
from zerodp.tools.models.gpt import GPT, MODEL_PRESETS, lm_loss

MIB = 2 ** 20
SETTINGS = [("off", None), ("on", {}), ("+cpu", {"cpu_checkpointing": True}),
            ("+Pa", {"partition_activations": True}),
            ("+Pa+cpu", {"partition_activations": True, "cpu_checkpointing": True})]


class HeapPeak(TorchDispatchMode):
    """Allocated heap bytes read after every operator; the highest reading."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, in_use_bytes())
        return out


def measure_step(step, device: torch.device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    base = in_use_bytes()
    with HeapPeak() as peak:
        step()
    return peak.peak - base


class _Checkpointed(torch.nn.Module):
    """A block run through `fn(block, x)` (for models without a checkpoint_fn hook)."""

    def __init__(self, block: torch.nn.Module, fn) -> None:
        super().__init__()
        self.block, self.fn = block, fn

    def forward(self, x):
        return self.block(x) if self.fn is None else self.fn(self.block, x)


def build(args, device, mpu, tracker):
    cfg = MODEL_PRESETS[args.model]
    if not args.tp_model:
        return GPT(cfg, seed=0).to(device), lambda logits, y: lm_loss(logits, y)
    try:
        from zerodp.tools.models.tp_gpt import TensorParallelGPT, tp_lm_loss
    except ImportError:
        raise SystemExit("--tp-model needs zerodp.tools.models.tp_gpt (the tensor-parallel GPT)") from None
    model = TensorParallelGPT(cfg, mpu, rng=tracker, seed=0).to(device)
    model.blocks = torch.nn.ModuleList(_Checkpointed(b, None) for b in model.blocks)
    return model, lambda logits, y: tp_lm_loss(logits, y, mpu.get_tensor_model_parallel_group())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", choices=list(MODEL_PRESETS))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--tp-model", action="store_true", help="the tensor-parallel GPT over the ranks")
    args = p.parse_args()
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cfg = MODEL_PRESETS[args.model]
    tracker = RNGStatesTracker()
    mpu = None
    if args.tp_model:
        from zerodp.tensor_parallel import ModelParallelUnit
        mpu = ModelParallelUnit(world)
    group = ModelParallelGroup(dist.group.WORLD, rank, world) if distributed else ModelParallelGroup.single()
    model, loss_fn = build(args, device, mpu, tracker)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.block_size + 1),
                        generator=torch.Generator().manual_seed(0)).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    rows = []
    for name, keys in SETTINGS:
        if keys and keys.get("partition_activations") and world == 1:
            continue
        checkpointer = None if keys is None else Checkpointer(Settings(**keys), group, tracker)
        fn = None if checkpointer is None else checkpointer.checkpoint
        if args.tp_model:
            for block in model.blocks:
                block.fn = fn
        else:
            model.checkpoint_fn = fn

        def step():
            loss_fn(model(x), y).backward()

        step()  # warm-up: one-off allocations (autograd's, the dispatch mode's) stay out of the measurement
        measure_step(step, device)
        if checkpointer is not None:
            checkpointer.kept_bytes.reset_peak()
        peak = measure_step(step, device)
        kept = checkpointer.kept_bytes.peak if checkpointer else {DEVICE: 0, HOST: 0}
        formula = activation_memory(
            cfg, args.micro_batch, cfg.block_size, 4, checkpointing=keys is not None,
            partition_degree=world if keys and keys.get("partition_activations") else 1,
            cpu_checkpointing=bool(keys and keys.get("cpu_checkpointing")),
            tensor_parallel=world if args.tp_model else 1)
        rows.append((name, peak, kept[DEVICE], kept[HOST], formula))
    everyone = [rows] if not distributed else [None] * world
    if distributed:
        dist.all_gather_object(everyone, rows)
    if rank == 0:
        what = "tensor-parallel GPT" if args.tp_model else "GPT"
        print(f"{what} {args.model}, micro-batch {args.micro_batch} x {cfg.block_size} tokens, fp32, "
              f"{world} rank(s) as the model-parallel group, device {device.type}")
        print("| setting | rank | peak measured | formula peak | kept device (measured / formula) | "
              "kept host (measured / formula) |")
        print("|---|---|---|---|---|---|")
        for r, rank_rows in enumerate(everyone):
            for name, peak, kept_dev, kept_host, f in rank_rows:
                fp = "-" if f is None else format_bytes(f.device)
                fd = "-" if f is None else format_bytes(f.kept_device)
                fh = "-" if f is None else format_bytes(f.kept_host)
                measured = ("-", "-") if name == "off" else (format_bytes(kept_dev), format_bytes(kept_host))
                print(f"| {name} | {r} | {format_bytes(peak)} | {fp} | {measured[0]} / {fd} | {measured[1]} / {fh} |")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
