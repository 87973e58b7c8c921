"""`zerodp train`'s settings: options, a --config file and a resumed run's `run.json`, resolved into one
validated `TrainArgs` before any rank starts, so that a user mistake fails as one line.

Precedence of settings: explicit option > --config file > the saved run.json of --resume > default.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ...comm.launch_env import read_launch_environment
from ...config import load_config
from ...errors import UsageError
from . import run_folder
from .device import default_nproc, visible_gpus
from ..models.gpt import MODEL_PRESETS

DEFAULT_STAGE = 3
# About 4-5 minutes for the small model on 2 CPU cores (see docs/cli.md for the measurement).
DEFAULT_STEPS = 600
DEFAULT_MICRO_BATCH = 8
DEFAULT_LR = 2e-3
# A periodic checkpoint costs about one step of the small model; every 100 steps loses at most ~1 minute.
DEFAULT_SAVE_EVERY = 100

@dataclass
class TrainArgs:
    """Everything a rank needs, resolved and validated before any rank starts (picklable)."""

    nproc: int
    steps: int
    model: str
    seq_len: int
    lr: float
    seed: int
    log_every: int
    out: str
    precision: str
    config: dict            # the zerodp config, as given keys (validated)
    resume: Optional[str] = None   # the folder passed to engine.load_checkpoint
    resume_tag: Optional[str] = None   # its tag (None: the one `latest` names)
    save_every: int = DEFAULT_SAVE_EVERY   # checkpoint every K steps (0: only at the end)
    max_restarts: int = 0          # the elastic agent restarts every rank this often after a failure
    tp: int = 1                    # tensor-parallel size: ranks per model copy (docs/tensor_parallel.md)



def under_launcher() -> bool:
    """True when this process is already a rank of a launched job: started by torchrun (or another env://
    launcher), srun or mpirun (comm/launch_env.py). A launch that cannot form one world raises LaunchError,
    one line on the command line, instead of training alone ([Note: one job or a clear stop])."""
    return read_launch_environment().distributed


def default_out() -> str:
    """`--out`'s default, a folder every rank of the job names alike: `runs/train-<id>` with torchrun's run id,
    SLURM's job and step ids, or (one process) the time. Under mpirun, which exports no shared id, the ranks
    cannot agree on a time: --out is required there."""
    launch = read_launch_environment()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None and launch.launcher == "slurm" and os.environ.get("SLURM_JOB_ID"):
        run_id = f"slurm{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    if run_id is None and launch.distributed:
        raise UsageError(f"this rank was started by {launch.launcher} without an id its ranks share, so they cannot "
                         f"agree on a default --out; pass --out DIR (a folder every node can see)")
    return f"runs/train-{run_id or time.strftime('%Y%m%d-%H%M%S')}"


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _precision_of(config: dict) -> str:
    if config.get("bf16", {}).get("enabled"):
        return "bf16"
    if config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def _saved_run(resume: Path) -> dict:
    for candidate in (resume / "run.json", resume.parent / "run.json"):
        if candidate.is_file():
            try:
                saved = json.loads(candidate.read_text())
            except json.JSONDecodeError as err:
                raise UsageError(f"{candidate}:{err.lineno}:{err.colno}: the run's saved settings are truncated or "
                                 f"not JSON ({err.msg}); restore the file, or move it away and give the settings "
                                 f"(--model, --seq-len, --config ...) as options") from None
            if not isinstance(saved, dict) or not isinstance(saved.get("args", {}), dict):
                raise UsageError(f"{candidate} does not hold a run's settings; move it away and give the settings "
                                 f"as options")
            return saved
    return {}


def resolve_train_args(opts: dict) -> TrainArgs:
    """Validated TrainArgs from the options the user gave (`opts`: name -> value, given ones only)."""
    saved: dict = {}
    resume_dir = None
    if opts.get("resume") is not None:
        resume = Path(opts["resume"])
        if not resume.is_dir():
            raise UsageError(f"--resume {resume}: no such directory (pass a run's --out folder or its checkpoints/)")
        resume_dir = resume / "checkpoints" if (resume / "checkpoints").is_dir() else resume
        saved = _saved_run(resume)
    saved_args = saved.get("args", {})

    def pick(name, default):
        return opts[name] if opts.get(name) is not None else saved_args.get(name, default)

    # The config: the built-in defaults overlaid with the --config file's keys (or, without a file, the
    # resumed run's config), then the options.
    config = {"zero_optimization": {"stage": DEFAULT_STAGE}, "gradient_clipping": 1.0}
    if opts.get("config") is not None:
        config = _deep_merge(config, load_config(opts["config"]).model_dump(exclude_unset=True))
    elif "config" in saved_args:
        config = saved_args["config"]
    if opts.get("stage") is not None:
        config = _deep_merge(config, {"zero_optimization": {"stage": opts["stage"]}})
    if opts.get("micro_batch") is not None:
        config["train_micro_batch_size_per_gpu"] = opts["micro_batch"]
    elif "train_batch_size" not in config and "train_micro_batch_size_per_gpu" not in config:
        config["train_micro_batch_size_per_gpu"] = DEFAULT_MICRO_BATCH
    if opts.get("checkpoint_activations"):  # an empty section: checkpointing with DeepSpeed's defaults
        config = _deep_merge(config, {"activation_checkpointing": {}})
    if opts.get("precision") is not None:
        p = opts["precision"]
        config = _deep_merge(config, {"bf16": {"enabled": p == "bf16"}, "fp16": {"enabled": p == "fp16"}})
    if opts.get("lr") is not None and "optimizer" in config:
        config = _deep_merge(config, {"optimizer": {"params": {"lr": opts["lr"]}}})
    validated = load_config(config)  # raises ConfigError

    gpus = visible_gpus()
    # default: one rank per GPU there is, 2 CPU ranks without one (device.default_nproc)
    nproc = read_launch_environment().world_size if under_launcher() else pick("nproc", default_nproc(gpus))
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    tp = pick("tp", 1)
    if tp < 1 or nproc % tp:
        raise UsageError(f"--tp {tp} must be at least 1 and divide --nproc {nproc}; pick a divisor of {nproc}")
    validated.resolve_batch(nproc // tp)  # ConfigError when the batch keys disagree with the data-parallel size
    if gpus and not under_launcher() and nproc > gpus:
        raise UsageError(f"--nproc {nproc} is more than the {gpus} GPU(s); with CUDA each rank needs its own GPU")
    if validated.optimizer is not None:
        from ...optim.inner import OptimizerError, resolve_optimizer

        sections = validated.optimizer if isinstance(validated.optimizer, list) else [validated.optimizer]
        for section in sections:  # hyper-parameters only: which parameters each selects is checked at start-up
            try:
                resolve_optimizer(None, section.model_copy(update={"select": None}),
                                  [torch.nn.Parameter(torch.zeros(1, 1))])  # 2-D: Muon takes only matrices
            except OptimizerError as err:
                raise UsageError(str(err)) from None
            except (TypeError, ValueError) as err:  # torch's own checks, e.g. "Invalid learning rate: -1"
                raise UsageError(f"the config's optimizer section ({section.type}) is refused by torch: "
                                 f"{err}; fix optimizer.params") from None

    model = pick("model", "small")
    if model not in MODEL_PRESETS:
        raise UsageError(f"unknown model '{model}'; choose one of {', '.join(MODEL_PRESETS)}")
    block, heads = MODEL_PRESETS[model].block_size, MODEL_PRESETS[model].n_head
    if heads % tp or MODEL_PRESETS[model].vocab_size % tp:
        raise UsageError(f"--tp {tp} must divide the {model} model's {heads} heads and "
                         f"{MODEL_PRESETS[model].vocab_size}-token vocabulary")
    seq_len = pick("seq_len", block)
    if not 1 <= seq_len <= block:
        raise UsageError(f"--seq-len {seq_len} is outside 1..{block}, the {model} model's block_size")
    steps, log_every, lr = pick("steps", DEFAULT_STEPS), pick("log_every", 25), pick("lr", DEFAULT_LR)
    if steps < 1 or log_every < 1:
        raise UsageError(f"--steps and --log-every must be at least 1, got {steps} and {log_every}")
    if not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"--lr must be a positive finite number, got {lr} (the default is {DEFAULT_LR:g})")
    save_every, max_restarts = pick("save_every", DEFAULT_SAVE_EVERY), opts.get("max_restarts") or 0
    if save_every < 0 or max_restarts < 0:
        raise UsageError(f"--save-every and --max-restarts must be at least 0, got {save_every} and {max_restarts}")
    if tp > 1 and max_restarts:
        raise UsageError("--max-restarts with --tp is not supported (a restart reads the plain checkpoint layout); "
                         "resume with --resume instead")
    if resume_dir is not None:
        _check_resumable(resume_dir, opts.get("tag"), tp)
    elif opts.get("tag") is not None:
        raise UsageError("--tag names the checkpoint to resume from; it needs --resume DIR")

    if opts.get("out") is not None:
        out = opts["out"]
    elif saved:  # resuming a run folder: continue writing into it
        out = str(Path(opts["resume"]) if (Path(opts["resume"]) / "run.json").is_file()
                  else Path(opts["resume"]).parent)
    else:
        out = default_out()
    # an elastic restart of this job, on any node (run.json names the job), or a resume of this folder
    restarted = run_folder.holds_this_job(Path(out)) if run_folder.this_job() is not None \
        else run_folder.restart_count() > 0
    continuing = restarted or (resume_dir is not None and Path(out).resolve() in
                               (resume_dir.resolve(), resume_dir.resolve().parent))
    try:
        run_folder.prepare(Path(out), continuing=continuing, overwrite=bool(opts.get("overwrite")))
    except run_folder.RunFolderError as err:
        raise UsageError(str(err)) from None
    return TrainArgs(nproc=nproc, steps=steps, model=model, seq_len=seq_len, lr=lr, seed=pick("seed", 0),
                     log_every=log_every, out=out, precision=_precision_of(validated.model_dump()),
                     config=validated.model_dump(exclude_unset=True),
                     resume=None if resume_dir is None else str(resume_dir), resume_tag=opts.get("tag"),
                     save_every=save_every, max_restarts=max_restarts, tp=tp)


def _check_resumable(ckpt_dir: Path, tag: Optional[str], tp: int = 1) -> None:
    """Find and read the checkpoint's metadata now, so that a bad --resume/--tag is one line, not a rank failure."""
    from ...checkpoint.deepspeed_reader import deepspeed_tag_dir
    from ...checkpoint.format import read_meta, resolve_tag_dir
    from ...errors import CheckpointError

    from ...checkpoint.tensor_parallel import saved_tp_size, tp_dir

    try:
        saved_tp = saved_tp_size(ckpt_dir) if ckpt_dir.is_dir() else None
        if (saved_tp or 1) != tp:
            raise CheckpointError(f"it was saved at tensor-parallel size {saved_tp or 1}; resume with --tp "
                                  f"{saved_tp or 1} (the data-parallel size may differ)")
        if saved_tp is None and deepspeed_tag_dir(ckpt_dir, tag) is not None:
            return  # a DeepSpeed ZeRO or universal checkpoint: read at the load (checkpoint/deepspeed_reader.py)
        read_meta(resolve_tag_dir(ckpt_dir if saved_tp is None else tp_dir(ckpt_dir, 0, saved_tp), tag))
    except CheckpointError as err:
        raise UsageError(f"--resume {ckpt_dir}: {err}") from None
