"""DeepSpeed's monitoring sections: `csv_monitor`, `tensorboard`, `wandb`, `comms_logger`, `flops_profiler`.

Keys, defaults and meanings are DeepSpeed's (its config reference and deepspeed/monitor/config.py),
so a DeepSpeed config's monitoring sections work unchanged. Every section is off by default; what an
enabled section writes is described in monitor/monitor.py. Configuration lives in the config package
(schema.py takes these sections from here); the monitor package imports it, never the other way round.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from .strict import StrictModel

# DeepSpeed's default job name: the folder under output_path that a run's files go to.
DEFAULT_JOB_NAME = "DeepSpeedJobName"

# The collectives zerodp issues (comms_logger.prof_ops), and DeepSpeed's names for them.
COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
COMM_OP_ALIASES = {
    "all_gather_into_tensor": "all_gather", "all_gather_base": "all_gather", "allgather_fn": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter", "inference_all_reduce": "all_reduce",
}


def canonical_op(name: str) -> str:
    """zerodp's name for a collective named the DeepSpeed way."""
    return COMM_OP_ALIASES.get(name, name)


class CSVMonitorConfig(StrictModel):
    """`csv_monitor`: one CSV file per event under output_path/job_name (rank 0)."""

    enabled: bool = Field(False, description="Write Train/Samples/train_loss, lr, loss_scale (fp16) and grad_norm "
                          "at every optimizer step, one file per event (Train_Samples_lr.csv: columns step, lr; "
                          "step counts samples, as DeepSpeed).")
    output_path: str = Field("", description="Folder the job's folder is created in ('' = the working directory).")
    job_name: str = Field(DEFAULT_JOB_NAME, description="Folder under output_path that this run's files go to.")


class TensorBoardConfig(StrictModel):
    """`tensorboard`: the same events as csv_monitor, as TensorBoard scalars (needs `pip install tensorboard`)."""

    enabled: bool = Field(False, description="Write the monitor's events with torch.utils.tensorboard.SummaryWriter "
                          "(rank 0). Needs the tensorboard package (`pip install tensorboard` or zerodp[monitor]).")
    output_path: str = Field("", description="Folder the job's folder is created in ('' = the working directory).")
    job_name: str = Field(DEFAULT_JOB_NAME, description="Folder under output_path holding the event files.")


class WandbConfig(StrictModel):
    """`wandb`: the same events logged to Weights & Biases (needs `pip install wandb`; never a dependency)."""

    enabled: bool = Field(False, description="Log the monitor's events with wandb.log on rank 0 (wandb.init is "
                          "called with project, group and team).")
    group: Optional[str] = Field(None, description="W&B group of runs.")
    team: Optional[str] = Field(None, description="W&B team (wandb.init's entity).")
    project: str = Field("deepspeed", description="W&B project.")


class CommsLoggerConfig(StrictModel):
    """`comms_logger`: count, bytes and time of every collective zerodp issues, per operation and size."""

    enabled: bool = Field(False, description="Record every collective (engine.comms_summary() returns and logs the "
                          "table; the engine logs it at close()). Off costs one list check per collective.")
    verbose: bool = Field(False, description="Also log each collective on rank 0 at the step it completed in.")
    prof_all: bool = Field(True, description="Record every operation; false: only those in prof_ops.")
    prof_ops: list[str] = Field(default_factory=list, description="Operations recorded when prof_all is false: "
                                "all_reduce, reduce_scatter, all_gather, broadcast (DeepSpeed's names "
                                "all_gather_into_tensor and reduce_scatter_tensor are read as the latter two).")
    debug: bool = Field(False, description="Break the table down by who issued each collective (its tag: grad, "
                        "param, norm, ...), where DeepSpeed appends the calling function's name.")

    @field_validator("prof_ops")
    @classmethod
    def _known_ops(cls, ops: list[str]) -> list[str]:
        for name in ops:
            if canonical_op(name) not in COMM_OPS:
                raise ValueError(f"'{name}' is not a collective zerodp issues; prof_ops takes "
                                 f"{', '.join(COMM_OPS)} (or DeepSpeed's {', '.join(COMM_OP_ALIASES)})")
        return ops


class FlopsProfilerConfig(StrictModel):
    """`flops_profiler`: FLOPs of one optimizer step (forward and backward) with torch.utils.flop_counter."""

    enabled: bool = Field(False, description="Count the FLOPs of every forward and backward of the step "
                          "profile_step and report them with the achieved FLOP/s (rank 0).")
    recompute_fwd_factor: float = Field(0.0, ge=0, le=1, description="Accepted for DeepSpeed configs; zerodp "
                                        "counts the operations that actually run, so activation recomputation "
                                        "is already included.")
    profile_step: int = Field(1, ge=-1, description="The optimizer step profiled (0 = the first; DeepSpeed's "
                              "default 1 skips the first, warm-up step; -1 = none, as in DeepSpeed).")
    module_depth: int = Field(-1, ge=-1, description="Deepest module level in the per-module table (-1 = all).")
    top_modules: int = Field(1, ge=1, description="Modules listed per level, largest FLOPs first.")
    detailed: bool = Field(True, description="Include the per-module table (false: totals only).")
    output_file: Optional[str] = Field(None, description="Write the report to this file (default: the log).")
