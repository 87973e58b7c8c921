"""The main job: `zerodp train` trains the bundled GPT on the embedded corpus across local ranks.

Two halves. The launcher half runs once, in the user's process: `train_args.resolve_train_args` turns
options, a config file and (on resume) the saved `run.json` into one validated `TrainArgs`, so user
mistakes fail there as one line, and then `launch` starts the ranks with torchrun's own launcher API
(`elastic_launch` with a `LaunchConfig`, standalone c10d rendezvous on localhost). When torchrun's
variables are already set (`torchrun --nproc_per_node 2 -m zerodp train ...`), or srun's or mpirun's are
(comm/launch_env.py, docs/multinode.md), it does not launch again: this process is a rank, and runs the
worker itself.

The worker half (`run_worker`) is the training loop every rank runs: GPT + AdamW through
`zerodp.initialize`, rank r of N reading its slice of each step's global batch
(`ByteCorpus.batch(step, r, N, ...)`, so a resumed run sees the same batches as an uninterrupted one),
then validation, a text sample, a checkpoint and the summary. Everything collective (the loss
average, validation, generation under stage 3, checkpointing) runs on every rank in the same order;
only printing and the metrics files are rank 0's.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import psutil
import torch

from ... import comm
from ...comm import launch_env
from ..plan import format_bytes
from . import run_folder
from .corpus import ByteCorpus
from .device import predicted_peak_cuda_bytes, rank_device, sample_generator
from ..models.gpt import GPT, MODEL_PRESETS, lm_loss
from ..models.tp_gpt import TensorParallelGPT, tp_lm_loss
from ...tensor_parallel import ModelParallelUnit, seed_model_parallel
from .train_args import TrainArgs, under_launcher
from .report import MetricsLog, activation_report, format_log_line, plot_loss, read_metrics, render_summary

WARMUP_FRACTION = 0.05   # linear warm-up over the first 5% of steps, then cosine decay to 10% of lr
VAL_BATCHES = 8          # micro-batches per rank for the validation loss
SAMPLE_PROMPT = "    def __init__(self, "
SAMPLE_NEW_BYTES = 200
SAMPLE_TOP_K = 10
SAMPLE_TEMPERATURE = 0.8


# ----------------------------------------------------------------------------------------------
# The launcher half.

def launch(args: TrainArgs) -> dict:
    """Run the job: as this rank under a launcher (torchrun, srun, mpirun), else start `args.nproc` local ranks
    and wait.

    Returns rank 0's result (the summary figures). Worker failures raise torch's ChildFailedError.
    """
    if under_launcher():
        return run_worker(args)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cpus = os.cpu_count() or 1
    if args.nproc > cpus:
        print(f"zerodp: warning: --nproc {args.nproc} is more than the {cpus} CPU core(s); ranks will share "
              f"cores and every step will be slower", file=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the ranks; torch reads it at import
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc,
                          run_id=f"zerodp-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=args.max_restarts, start_method="spawn")
    results = elastic_launch(config, run_worker)(args)
    return results.get(0, {})


# -- The worker half: one rank. ----------------------------------------------------------------

def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def lr_at(step: int, steps: int, base_lr: float) -> float:
    """Linear warm-up, then cosine decay from base_lr to base_lr / 10 at the last step."""
    warmup = max(1, int(WARMUP_FRACTION * steps))
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _build_optimizer(model: GPT, args: TrainArgs):
    """AdamW with weight decay on matrices only (nanoGPT's split), unless the config names an optimizer."""
    if "optimizer" in args.config:
        return None  # zerodp.initialize builds it from the config's section
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def _device() -> torch.device:
    """This rank's GPU when CUDA is available (NCCL needs CUDA tensors), else the CPU (device.py)."""
    return rank_device(torch.cuda.is_available(), launch_env.local_rank())


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    comm.all_reduce(t, tag="metrics")  # note: a sync point (tiny); every rank reports the same loss
    return float(t) / comm.get_world_size()


@torch.no_grad()
def evaluate(engine, corpus: ByteCorpus, args: TrainArgs) -> float:
    """Mean loss over VAL_BATCHES validation micro-batches per rank, averaged over ranks.

    eval() + no_grad: at stage 3 each unit is gathered by the first batch only and kept for the
    others (stage3/inference_cache.py); engine.train() at the end releases them."""
    engine.eval()
    total = 0.0
    for i in range(VAL_BATCHES):  # engine.rank / world_size: the data-parallel ones (with --tp, copies of the model)
        x, y = corpus.batch(i, engine.rank, engine.world_size, engine.micro_batch_size, args.seq_len, split="val",
                            seed=args.seed)
        x, y = x.to(_device()), y.to(_device())
        total += float(_loss(engine, engine(x), y))
    engine.train()
    return _mean_over_ranks(total / VAL_BATCHES)


@torch.no_grad()
def sample_text(engine, args: TrainArgs) -> str:
    """Top-k sample from the trained model. Runs on every rank: under stage 3 each forward gathers
    parameters collectively, so all ranks must take the same number of forwards (same seed, same text).
    As in `evaluate`, units gathered by the first token's forward stay gathered until engine.train().
    The generator lives on the prompt's device (device.sample_generator_device): on a GPU, a CUDA one."""
    engine.eval()
    prompt = ByteCorpus.encode(SAMPLE_PROMPT).long()[None].to(_device())
    generator = sample_generator(prompt.device, args.seed)
    tokens = engine.module.generate(prompt, SAMPLE_NEW_BYTES, temperature=SAMPLE_TEMPERATURE,
                                    top_k=SAMPLE_TOP_K, generator=generator)
    engine.train()
    return ByteCorpus.decode(tokens[0])


def _save_checkpoint(engine, args: TrainArgs, step: int) -> tuple[Optional[str], str]:
    path = engine.save_checkpoint(Path(args.out) / "checkpoints", client_state={"step": step, "args": asdict(args)})
    return str(path), ""


def _loss(engine, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss; with --tp from this rank's vocabulary slice (vocab-parallel cross entropy)."""
    if engine.mpu is None:
        return lm_loss(logits, targets)
    return tp_lm_loss(logits, targets, engine.mpu.get_tensor_model_parallel_group())


def _banner(engine, args: TrainArgs, world: int, numel: int, base_lr: float) -> str:
    copies = engine.world_size  # data-parallel: with --tp, world / tp copies of the model
    tokens = copies * engine.micro_batch_size * engine.gradient_accumulation_steps * args.seq_len
    tp = f" = tensor-parallel {args.tp} x data-parallel {copies}" if args.tp > 1 else ""
    per = " per tensor-parallel rank" if args.tp > 1 else ""
    return (f"zerodp train: stage {engine.stage}, {world} rank(s){tp} x {torch.get_num_threads()} thread(s), "
            f"model {args.model} ({numel:,} parameters{per}), {args.precision}, micro-batch "
            f"{engine.micro_batch_size} x seq {args.seq_len} x accumulation {engine.gradient_accumulation_steps} x "
            f"{copies} cop{'y' if copies == 1 else 'ies'} = {tokens:,} tokens/step, {args.steps} steps, peak lr "
            f"{base_lr:g}, out {args.out}")


def run_worker(args: TrainArgs) -> dict:
    """Train on this rank (the entry point each launched rank runs); returns rank 0's summary figures."""
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        return record(_run_worker)(args)  # record: a rank's traceback reaches the launcher's error report
    finally:
        if comm.owns_default_group():
            comm.destroy_distributed()  # before interpreter shutdown: see [Note: teardown] in comm/process_group.py


def _run_worker(args: TrainArgs) -> dict:
    import zerodp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    wall_start = time.perf_counter()
    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    out = Path(args.out)

    torch.manual_seed(args.seed)
    mpu = None if args.tp == 1 else ModelParallelUnit(args.tp)  # --tp: Megatron's cut (docs/tensor_parallel.md)
    if mpu is None:
        model = GPT(MODEL_PRESETS[args.model], seed=args.seed).to(_device())
    else:  # attention dropout forks the process's tracker, which a checkpointed block's recompute restores
        model = TensorParallelGPT(MODEL_PRESETS[args.model], mpu, rng=zerodp.activations.PROCESS.tracker,
                                  seed=args.seed).to(_device())
    engine = zerodp.initialize(model, _build_optimizer(model, args), args.config, mpu=mpu)
    if mpu is not None:
        if "activation_checkpointing" in args.config:  # partitioned over the tensor-parallel group, if asked
            zerodp.deepspeed.checkpointing.configure(mpu, deepspeed_config=args.config)
        seed_model_parallel(zerodp.activations.PROCESS.tracker, args.seed, mpu.get_tensor_model_parallel_rank())
    if "activation_checkpointing" in args.config:  # --checkpoint-activations, or the config's section
        model.checkpoint_fn = zerodp.activations.checkpoint  # as the section configured it (in initialize)
    try:
        return _train(engine, args, model, out, rank, world, wall_start)
    finally:
        engine.close()  # hooks, communicators, I/O threads, offload files: see ZeroEngine.close
        if mpu is not None:
            mpu.destroy()


def _train(engine, args: TrainArgs, model, out: Path, rank: int, world: int, wall_start: float) -> dict:
    numel = model.num_parameters()
    base_lr = engine.optimizer.param_groups[0]["lr"]  # read before a checkpoint restores a scheduled lr
    corpus = ByteCorpus.from_stdlib()
    start_step = 0
    resume, tag, restart = args.resume, args.resume_tag, run_folder.restart_count()
    if restart and run_folder.restart_checkpoint(out) is not None:
        resume, tag = str(run_folder.restart_checkpoint(out)), None  # this run's newest complete checkpoint
    if resume:
        client = engine.load_checkpoint(resume, tag=tag) or {}
        start_step = int(client.get("step", engine.global_step))
    if rank == 0:  # written once the checkpoint loaded: a refused resume leaves the run's settings as they were
        out.mkdir(parents=True, exist_ok=True)
        # "job": the elastic job that owns the folder, so that its restarted attempts continue it (run_folder)
        (out / "run.json").write_text(json.dumps({"args": asdict(args), "job": run_folder.this_job()}, indent=2)
                                      + "\n")
        print(_banner(engine, args, world, numel, base_lr)
              + (f", resumed at step {start_step}" if resume else ""), flush=True)
        if restart:
            print(f"zerodp train: restarted (restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}"
                  f") after a rank failed; resuming from step {start_step}"
                  + (f" (checkpoint {resume})" if resume else " (no checkpoint yet: from the start)"), flush=True)
    if start_step >= args.steps:
        if rank == 0:
            print(f"zerodp train: the checkpoint is at step {start_step} >= --steps {args.steps}; nothing to do "
                  f"(pass a larger --steps to train further)")
        return {"step": start_step}
    history = train_steps(engine, corpus, args, start_step, base_lr)
    return _finish(engine, corpus, args, history, numel, wall_start)


def train_steps(engine, corpus: ByteCorpus, args: TrainArgs, start_step: int, base_lr: float) -> list[dict]:
    """Optimizer steps start_step..args.steps-1; rank 0 logs them. Returns this launch's metric rows."""
    from tqdm import tqdm

    rank, world = comm.get_rank(), comm.get_world_size()
    metrics = MetricsLog(Path(args.out)) if rank == 0 else None
    # engine.world_size: the data-parallel copies (with --tp, world / tp of them see distinct data)
    tokens_per_step = engine.world_size * engine.micro_batch_size * engine.gradient_accumulation_steps * args.seq_len
    # The bar is for a terminal; in a pipe or a log file the log lines carry the same figures.
    bar = tqdm(total=args.steps, initial=start_step, disable=rank != 0 or not sys.stderr.isatty(), unit="step",
               dynamic_ncols=True, mininterval=0.5, desc="train")
    proc = psutil.Process()
    history: list[dict] = []
    ckpt_dir = Path(args.out) / run_folder.CHECKPOINTS_DIR
    rotation = run_folder.CheckpointRotation(ckpt_dir)
    for step in range(start_step, args.steps):
        lr = lr_at(step, args.steps, base_lr)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        loss_sum = 0.0
        for micro in range(engine.gradient_accumulation_steps):
            x, y = corpus.batch(step, engine.rank, engine.world_size, engine.micro_batch_size, args.seq_len,
                                micro_step=micro, seed=args.seed)
            loss = _loss(engine, engine(x.to(_device())), y.to(_device()))
            engine.backward(loss)
            engine.step()
            loss_sum += float(loss.detach())
        loss_mean = _mean_over_ranks(loss_sum / engine.gradient_accumulation_steps)
        step_time = time.perf_counter() - t0
        row = {"step": step + 1, "loss": loss_mean, "lr": lr, "grad_norm": engine.grad_norm,
               "loss_scale": engine.loss_scale, "tokens_per_s": tokens_per_step / step_time,
               "step_time_s": step_time, "rss_bytes": proc.memory_info().rss}
        history.append(row)
        if rank == 0:
            metrics.write(row)
            bar.set_postfix_str(f"loss {loss_mean:.3f}, {row['tokens_per_s']:,.0f} tok/s, "
                                f"rss {format_bytes(row['rss_bytes'])}", refresh=False)
            bar.update(1)
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                tqdm.write(format_log_line(row, args.steps))
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            # note: collective; every rank writes its shards. The final step's checkpoint is _finish's.
            path = engine.save_checkpoint(ckpt_dir, client_state={"step": step + 1, "args": asdict(args)})
            if rank == 0:
                rotation.add(path)
                tqdm.write(f"checkpoint: {path} (step {step + 1})")
    bar.close()
    if metrics is not None:
        metrics.close()
    return history


def _finish(engine, corpus: ByteCorpus, args: TrainArgs, history: list[dict], numel: int,
            wall_start: float) -> dict:
    """Memory report, checkpoint, validation, sample (every rank, in this order), then rank 0's summary."""
    rank, world, out = comm.get_rank(), comm.get_world_size(), Path(args.out)
    report = engine.memory_report().as_dict()
    report["rank"] = rank  # the world's rank (with --tp the engine's rank is the data-parallel one)
    # Stage-3 units small enough to stay whole on every rank (the formula assumes everything sharded).
    report["persistent_param_bytes"] = sum(u.param_bytes() for u in engine.units if getattr(u, "persistent", False))
    if torch.cuda.is_available():  # the training steps' peak, before validation and the sample gather more
        report["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        report["peak_cuda_bytes_predicted"] = None if args.tp > 1 else \
            predicted_peak_cuda_bytes(args.model, engine.config, world, args.seq_len)  # the formula knows no --tp
    checkpoint, checkpoint_note = _save_checkpoint(engine, args, args.steps)
    val_loss = evaluate(engine, corpus, args)
    sample = sample_text(engine, args)
    report.update(activation_report(args, engine.micro_batch_size))
    report["peak_rss_bytes"] = _peak_rss_bytes()
    ranks = comm.all_gather_object(report)
    if rank != 0:
        return {}
    all_rows = read_metrics(out)  # the whole run, steps before a resume included
    plot, plot_note = plot_loss(out, all_rows, val_loss, f"zerodp stage {engine.stage}, {world} ranks, "
                                f"GPT {args.model}")
    timed = history[1:] or history  # the first step of a launch includes one-off warm-up
    window = min(10, len(history))
    run = {"stage": engine.stage, "world_size": world, "tensor_parallel": args.tp, "model": args.model, "numel": numel,
           "precision": args.precision, "first_step": history[0]["step"], "last_step": args.steps,
           "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
           "step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
           "initial_loss": all_rows[0]["loss"] if all_rows else history[0]["loss"],
           "final_loss": sum(r["loss"] for r in history[-window:]) / window, "final_loss_window": window,
           "val_loss": val_loss, "checkpoint": checkpoint, "checkpoint_note": checkpoint_note,
           "plot": None if plot is None else str(plot), "plot_note": plot_note, "out": str(out),
           "wall_time_s": time.perf_counter() - wall_start}
    print("\n" + render_summary(run, ranks))
    print(f"\nsample (top-{SAMPLE_TOP_K}, temperature {SAMPLE_TEMPERATURE}, {SAMPLE_NEW_BYTES} bytes after the "
          f"prompt):\n{'-' * 60}\n{sample}\n{'-' * 60}", flush=True)
    (out / "sample.txt").write_text(sample + "\n")
    summary = {"run": run, "ranks": ranks, "sample": sample}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

