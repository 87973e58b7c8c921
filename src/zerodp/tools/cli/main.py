"""The `zerodp` command: `train`, `estimate` and `consolidate`.

    zerodp train [--stage 0-3] [--nproc N] [--steps S] [--model tiny|small|base] ...
    zerodp estimate --params 7.5e9 --world-size 64      (or --model small, or --paper)
    zerodp consolidate CKPT_DIR OUT [--tag T] [--max-shard-size 5GB] [--config config.json]

This module owns the options, their help text and the error contract: a user mistake (a bad
option or config, a missing folder) is one line on stderr and exit code 2, never a traceback. The
job itself lives in `app/train.py`, the estimates in `plan/`, consolidation in `checkpoint/`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Optional

from ...errors import ConfigError, UsageError
from ..models.gpt import MODEL_PRESETS
from ..app.train_args import DEFAULT_LR, DEFAULT_MICRO_BATCH, DEFAULT_SAVE_EVERY, DEFAULT_STAGE, DEFAULT_STEPS
from ..plan import OPTIMIZER_STATES, WHOLE_TENSOR_OPTIMIZERS
from ..plan.scaling.workload import parse_count

PAPER_MODELS = (7.5e9, 128e9, 1e12)
PAPER_DP_DEGREES = (1, 4, 16, 64, 256, 1024)
STAGE_NAMES = {0: "baseline DP (nothing sharded)", 1: "Pos (optimizer states)", 2: "Pos+g (+ gradients)",
               3: "Pos+g+p (+ parameters)"}
TRAIN_OPTIONS = ("config", "stage", "nproc", "steps", "model", "micro_batch", "seq_len", "lr", "precision",
                 "resume", "out", "log_every", "seed", "save_every", "max_restarts", "overwrite", "tag",
                 "checkpoint_activations", "tp")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit code 2."""

    def error(self, message: str):  # noqa: D401 (argparse's name)
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _wrap(text: str) -> str:
    return textwrap.fill(text, 100)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zerodp", description="ZeRO data parallelism for PyTorch: train the bundled GPT "
                     "across local ranks, estimate per-rank memory, consolidate checkpoints.",
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="'zerodp COMMAND --help' explains each command's options.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_estimate(sub)
    _add_consolidate(sub)
    _add_bench(sub)
    return parser


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="(moved) the benchmark harness runs from a source checkout: make bench",
                       description=_wrap("The side-by-side benchmark (DDP, ZeroRedundancyOptimizer, FSDP1/2, "
                                         "DeepSpeed and zerodp's stages) is not part of the installed package: "
                                         "from a checkout of the repository run `make bench` or "
                                         "`python -m bench.harness --help`."))
    p.set_defaults(func=lambda ns: _bench_moved([]))


def _bench_moved(args: list[str]) -> int:
    command = " ".join(["python -m bench.harness", *args])
    print(f"zerodp bench: the benchmark harness is not part of the installed package; from a checkout of the "
          f"repository run `make bench` or `{command}`", file=sys.stderr)
    return 2


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train the bundled GPT with ZeRO on local ranks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrap("Train the bundled GPT (zerodp.tools.models.gpt) on the Python standard library's source "
                    "(byte tokens, nothing to download) across N local ranks started with torchrun's launcher "
                    "API. Shows a progress bar, logs every K steps, writes metrics.jsonl/metrics.csv, and at the "
                    "end prints per-rank memory (measured and predicted), the validation loss and a text sample, "
                    "draws loss.png and saves a checkpoint, all under --out."),
        epilog="Settings come from, in order of precedence: these options, the --config file, the run.json "
               "saved in a --resume folder, the defaults.\n\n"
               "Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set), srun or mpirun nothing is launched and --nproc is "
               "ignored (docs/multinode.md):\n"
               "  torchrun --nproc_per_node 2 -m zerodp train --stage 2 --steps 100\n"
               "  srun --ntasks 4 python -m zerodp train --stage 2 --steps 100\n\n"
               "examples:\n"
               "  zerodp train                                  # the default job: stage 3, 2 ranks, ~5 min\n"
               "  zerodp train --stage 1 --model tiny --steps 50 --out runs/s1\n"
               "  zerodp train --resume runs/s1 --steps 100     # continue runs/s1 up to step 100")
    p.add_argument("--config", metavar="FILE", help="zerodp/DeepSpeed config (.json, .yaml); the options below "
                   "override its keys. Default: stage 3, gradient clipping 1.0, micro-batch 8.")
    p.add_argument("--stage", type=int, choices=range(4), metavar="{0,1,2,3}",
                   help=f"ZeRO stage: 0 plain data parallel, 1 shards optimizer states, 2 also gradients, 3 also "
                        f"parameters (default {DEFAULT_STAGE}; sets zero_optimization.stage)")
    p.add_argument("--nproc", type=int, metavar="N", help="local ranks to launch, one process each (default: one per "
                   "GPU there is, 2 without a GPU; more than the CPU cores is allowed but warned about)")
    p.add_argument("--steps", type=int, metavar="S", help=f"optimizer steps of the whole run, counting steps "
                   f"done before a --resume (default {DEFAULT_STEPS})")
    p.add_argument("--model", choices=list(MODEL_PRESETS), help="GPT preset (default small, ~3.3M parameters; "
                   "tiny ~0.12M for tests; base ~25M)")
    p.add_argument("--micro-batch", type=int, metavar="B", help="sequences per rank per forward (default "
                   f"{DEFAULT_MICRO_BATCH}; sets train_micro_batch_size_per_gpu)")
    p.add_argument("--seq-len", type=int, metavar="T", help="tokens (bytes) per sequence, at most the model's "
                   "block_size (default: the block_size: tiny 64, small 128, base 256)")
    p.add_argument("--lr", type=float, metavar="LR", help=f"peak AdamW learning rate, reached after a 5%% linear "
                   f"warm-up and decayed by a cosine to a tenth (default {DEFAULT_LR:g})")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="compute dtype; bf16/fp16 keep fp32 "
                   "master weights, fp16 adds dynamic loss scaling (default fp32; sets bf16/fp16.enabled)")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint: a previous run's --out folder "
                   "(its checkpoints/ is used and its run.json supplies the settings) or a checkpoints folder")
    p.add_argument("--out", metavar="DIR", help="output folder for metrics, plot, sample, summary.json and "
                   "checkpoints/ (default runs/train-<time>; with --resume of a run folder, that folder)")
    p.add_argument("--tag", metavar="T", help="with --resume: the checkpoint to resume from, e.g. global_step200 "
                   "(default: the one the checkpoints folder's 'latest' file names)")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out (its metrics, "
                   "summary and checkpoints); without it, re-using a run's folder is refused")
    p.add_argument("--save-every", type=int, metavar="K", help=f"also save a checkpoint every K steps, keeping "
                   f"the newest 2 (default {DEFAULT_SAVE_EVERY}; 0: only at the end)")
    p.add_argument("--max-restarts", type=int, metavar="N", help="when a rank dies, restart every rank up to N "
                   "times from the newest checkpoint (torch's elastic agent; default 0)")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size: N consecutive ranks hold one copy of "
                   "the model, each 1/N of its heads, MLP width and vocabulary (Megatron's cut), and ZeRO shards over "
                   "the nproc/N copies; the summary shows each rank's share (default 1; docs/tensor_parallel.md)")
    p.add_argument("--checkpoint-activations", action="store_true", default=None, help="checkpoint every "
                   "block's activations (recomputed in backward), kept as the config's activation_checkpointing "
                   "section says (which also switches this on); the summary shows the activation memory")
    p.add_argument("--log-every", type=int, metavar="K", help="print a log line every K steps (default 25)")
    p.add_argument("--seed", type=int, metavar="S", help="seed of the initial weights, the data order and the "
                   "sample (default 0)")
    p.set_defaults(func=_cmd_train)


def _add_estimate(sub) -> None:
    p = sub.add_parser(
        "estimate", help="per-rank model-state memory of each ZeRO stage (the paper's formulas)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrap("Print the memory of model states (parameters, gradients, optimizer states) that one rank "
                    "holds under each ZeRO stage: (2+2+K)*Psi bytes unsharded for mixed-precision Adam (K=12), "
                    "divided by N for what a stage shards (Rajbhandari et al., SC20, section 3)."),
        epilog="examples:\n"
               "  zerodp estimate --params 7.5e9 --world-size 64   # 120 / 31.4 / 16.6 / 1.88 GB\n"
               "  zerodp estimate --model small --world-size 2     # the local job, with activations\n"
               "  zerodp estimate --paper                          # Table 1 of the paper\n"
               "  zerodp estimate --cluster h100-8x400g --model-size 70b --gpus 64,1024   # step time by mode")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", metavar="PSI", help="parameter count: 7.5e9, 7.5B, 350M, 1T")
    what.add_argument("--model", choices=list(MODEL_PRESETS), help="a bundled GPT preset: its exact "
                      "parameter count, plus activation and buffer memory")
    what.add_argument("--paper", action="store_true", help="print the paper's Table 1 (7.5B, 128B and 1T "
                      "parameters at DP degree 1 to 1024)")
    from ..plan.scaling.cli import add_cluster_options
    add_cluster_options(p, what)
    p.add_argument("--world-size", type=int, metavar="N", help="data-parallel ranks (default 64 with --params, "
                   "2 with --model)")
    p.add_argument("--stage", type=int, choices=range(4), metavar="{0,1,2,3}", help="print only this stage")
    p.add_argument("--precision", choices=("mixed", "fp32"), help="mixed: 2-byte params and grads plus an fp32 "
                   "master copy in K; fp32: 4-byte params and grads, no copy (default mixed with --params, fp32 "
                   "with --model, as `zerodp train` runs)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adam", help="sets the fp32 "
                   "states per parameter: adam/adamw/lamb 2, sgd/adagrad 1, sgd-nomomentum 0 (default adam)")
    p.add_argument("--offload", choices=("cpu", "nvme"), help="also print where an offloaded run keeps its "
                   "model states per rank: device, host and disk bytes (offload_optimizer.device)")
    p.add_argument("--offload-param", choices=("cpu", "nvme"), help="stage 3: also offload the parameter shards "
                   "(offload_param.device); prints the same device/host/disk table")
    p.add_argument("--max-in-cpu", type=float, metavar="M", help="with --offload-param nvme: "
                   "parameter elements cached in host memory (offload_param.max_in_cpu; default 1e9 in the tier table, "
                   "while --peak-rss follows the engine: unset caches buffer_count x the largest shard)")
    p.add_argument("--sub-group-size", type=float, metavar="W", help="with --offload nvme: "
                   "elements per streamed window (zero_optimization.sub_group_size; default 4e6, what an unset "
                   "config gets)")
    p.add_argument("--buffer-count", type=int, metavar="B", help="with --offload nvme: I/O buffers "
                   "(offload_optimizer.buffer_count, default 4)")
    p.add_argument("--micro-batch", type=int, metavar="B",
                   help=f"with --model: sequences per rank, for the activation estimate "
                        f"(default {DEFAULT_MICRO_BATCH})")
    p.add_argument("--seq-len", type=int, metavar="T", help="with --model: tokens per sequence (default: the "
                   "model's block_size)")
    p.add_argument("--tp", type=int, default=2, metavar="T", help="with --model: the tensor-parallel degree the "
                   "partitioned-activation (Pa) rows of the activation table assume (default 2)")
    from .estimate_rss import add_peak_options
    add_peak_options(p)
    p.set_defaults(func=_cmd_estimate)


def _add_consolidate(sub) -> None:
    from ...checkpoint.consolidate import CLI_DESCRIPTION, add_consolidate_arguments

    p = sub.add_parser("consolidate", help="merge a sharded checkpoint into the full model (Hugging Face layout)",
                       description=_wrap(CLI_DESCRIPTION))
    add_consolidate_arguments(p)
    p.set_defaults(func=_cmd_consolidate)


# ----------------------------------------------------------------------------------------------
# Commands.

def _cmd_train(ns: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..app.train import launch
    from ..app.train_args import resolve_train_args, under_launcher
    from .launch_report import failure_line, launcher_log

    args = resolve_train_args({k: getattr(ns, k) for k in TRAIN_OPTIONS})
    if under_launcher():
        launch(args)  # this process is a rank: torchrun reports failures itself
        return 0
    with launcher_log(Path(args.out)) as log_path:
        try:
            launch(args)
        except ChildFailedError as err:
            code, line = failure_line(err, log_path)
            print(f"zerodp: error: {line}", file=sys.stderr)
            return code
        except (KeyboardInterrupt, SignalException):
            from ..app.run_folder import restart_checkpoint

            saved = restart_checkpoint(Path(args.out)) is not None
            print("zerodp: interrupted; " + (f"continue from the newest checkpoint with --resume {args.out}" if saved
                  else "no checkpoint was saved yet (see --save-every)"), file=sys.stderr)
            return 130
    return 0


def _unit(total_bytes: float) -> tuple[str, float]:
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if total_bytes >= size:
            return name, size
    return "B", 1.0


def render_estimate(numel: float, world_size: int, precision: str, optimizer: str,
                    stages: tuple[int, ...] = (0, 1, 2, 3)) -> str:
    """The per-stage model-state table for one rank (decimal units, rounded as the paper's Table 1)."""
    from ..plan import format_param_count, paper_round, precision_bytes, predict_model_state_bytes

    p, g, k = precision_bytes(precision, optimizer)
    unit, size = _unit((p + g + k) * numel)
    lines = [f"model states per rank: Psi = {format_param_count(numel)} parameters ({int(numel):,}), "
             f"N = {world_size} rank(s), {precision} precision, {optimizer}: {p} + {g} + K={k} bytes per parameter",
             f"(decimal units, 1 {unit} = {size:.0e} bytes, rounded as the paper's Table 1)",
             f"| stage | sharded | params ({unit}) | grads ({unit}) | optimizer ({unit}) | total ({unit}) |",
             "|---|---|---|---|---|---|"]
    for stage in stages:
        b = predict_model_state_bytes(int(numel), world_size, stage, param_bytes=p, grad_bytes=g, optimizer_bytes=k)
        cells = [paper_round(v / size) for v in (b.params, b.grads, b.optimizer, b.total)]
        lines.append(f"| {stage} | {STAGE_NAMES[stage]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _render_model_extras(model: str, numel: int, world_size: int, precision: str, micro_batch: int,
                         seq_len: int, tp: int = 2) -> str:
    from ...config import ZeroOptimizationConfig
    from ..plan import format_bytes
    from ..plan.activation_memory import render_activation_table

    cfg = MODEL_PRESETS[model]
    elem = 2 if precision == "mixed" else 4
    zero = ZeroOptimizationConfig()
    bucket = min(zero.reduce_bucket_size, numel) * elem
    live = min(zero.stage3_max_live_parameters, numel) * elem
    return "\n".join([
        render_activation_table(cfg, micro_batch, seq_len, elem, tp),
        "  assumes: fused SDPA attention (no T x T matrix saved), dropout off, the loss's fp32 log-probabilities "
        "(B*T*V*4 bytes); not sharded by ZeRO-DP, the same at every stage (plan/activation_memory.py)",
        "temporary buffers per rank, upper bounds from the config defaults (not in the table above):",
        f"  stage 2: a full gradient bucket while it is reduced, min(reduce_bucket_size, Psi) elements = "
        f"{format_bytes(bucket)}",
        f"  stage 3: gathered full parameters, min(stage3_max_live_parameters, Psi) elements = {format_bytes(live)}"
        f", plus a full gradient bucket of {format_bytes(bucket)} during backward",
        f"  (N = {world_size}; the torch runtime itself takes a few hundred MB of RSS per process on top: add "
        f"--peak-rss for each rank's whole peak RSS, docs/memory.md)"])


def _render_whole_tensor_imbalance(model: str, numel: int, world_size: int, optimizer: str) -> str:
    """One line: how far whole-tensor ownership puts the fullest rank above Psi/N for this model."""
    import torch

    from ..models.gpt import GPT
    from ..plan import whole_tensor_shard_numel

    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        shapes = [tuple(p.shape) for p in GPT(MODEL_PRESETS[model]).parameters()]
    fullest, fair = whole_tensor_shard_numel(shapes, world_size), -(-numel // world_size)
    return (f"whole-tensor ownership ({optimizer}: each rank owns whole tensors, all parameters assumed in its "
            f"groups): the fullest rank owns {fullest:,} elements vs Psi/N = {fair:,} (+{fullest / fair - 1:.1%}); "
            f"its optimizer state scales by that factor at stages 1-3, and at stages 1-2 its padded shards and the "
            f"collectives too (stage 3's whole-tensor shards are unpadded and move Psi)")


def _cmd_estimate(ns: argparse.Namespace) -> int:
    from ..plan import estimate_model_numel, render_paper_table

    from ..plan.scaling.cli import refuse_unused_options, run

    refuse_unused_options(ns)
    if ns.cluster is not None:
        return run(ns)
    from .estimate_rss import refuse_misplaced, run_peak, wants_peak
    refuse_misplaced(ns)
    if wants_peak(ns):
        return run_peak(ns)
    if ns.paper:
        print("ZeRO paper, Table 1: per-device model-state memory (GB) of mixed-precision Adam (K=12) by DP "
              "degree; Pos = stage 1, Pos+g = stage 2, Pos+g+p = stage 3")
        print(render_paper_table(PAPER_MODELS, PAPER_DP_DEGREES))
        return 0
    if ns.model is not None:
        numel, world, precision = estimate_model_numel(MODEL_PRESETS[ns.model]), ns.world_size or 2, \
            ns.precision or "fp32"
    else:
        numel, world, precision = parse_count(ns.params), ns.world_size or 64, ns.precision or "mixed"
    if world < 1:
        raise UsageError(f"--world-size must be at least 1, got {world}")
    stages = (0, 1, 2, 3) if ns.stage is None else (ns.stage,)
    print(render_estimate(numel, world, precision, ns.optimizer, stages))
    if ns.offload is not None or ns.offload_param is not None:
        from ..plan import OPTIMIZER_STATES, precision_bytes
        from ..plan.offload_estimate import render_offload_estimate

        print(render_offload_estimate(numel, world, precision_bytes(precision, ns.optimizer),
                                      OPTIMIZER_STATES[ns.optimizer], ns.offload or "none", stages,
                                      4e6 if ns.sub_group_size is None else ns.sub_group_size,
                                      4 if ns.buffer_count is None else ns.buffer_count, ns.offload_param or "none",
                                      1e9 if ns.max_in_cpu is None else ns.max_in_cpu))
    if ns.model is not None and ns.optimizer in WHOLE_TENSOR_OPTIMIZERS:
        print(_render_whole_tensor_imbalance(ns.model, numel, world, ns.optimizer))
    if ns.model is not None:
        block = MODEL_PRESETS[ns.model].block_size
        seq_len = ns.seq_len or block
        micro_batch = DEFAULT_MICRO_BATCH if ns.micro_batch is None else ns.micro_batch
        if not 1 <= seq_len <= block or micro_batch < 1 or ns.tp < 1:
            raise UsageError(f"--seq-len must be in 1..{block}, --micro-batch and --tp at least 1")
        print(_render_model_extras(ns.model, numel, world, precision, micro_batch, seq_len, ns.tp))
    return 0


def _cmd_consolidate(ns: argparse.Namespace) -> int:
    if not Path(ns.ckpt_dir).is_dir():
        raise UsageError(f"{ns.ckpt_dir}: no such checkpoint folder")
    try:
        from ...checkpoint import consolidate_main
    except ImportError:
        print("zerodp: error: consolidation needs zerodp.checkpoint, which this installation does not have",
              file=sys.stderr)
        return 1
    argv = [ns.ckpt_dir, ns.out] + [arg for option, value in (("--tag", ns.tag), ("--max-shard-size",
                                    ns.max_shard_size), ("--config", ns.config)) if value is not None
                                    for arg in (option, value)]
    # consolidate_main prints its refusal (a missing or damaged checkpoint) as one line; a user mistake: exit 2
    return 2 if consolidate_main(argv) else 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `zerodp` console script; returns the exit code."""
    parser = build_parser()
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["bench"] and not {"-h", "--help"} & set(args[1:2]):
        return _bench_moved(args[1:])  # the harness's own options are not this parser's to check
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except (UsageError, ConfigError) as err:
        # A ConfigError message may span lines (one per bad key); the contract is one line.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        head, rest = (lines[0] + " ", lines[1:]) if lines[0].endswith(":") and len(lines) > 1 else ("", lines)
        message = head + "; ".join(rest)
        print(f"zerodp: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
