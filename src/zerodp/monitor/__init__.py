"""Monitoring, as DeepSpeed's config sections ask for it (see monitor.py for what is written when):

  (config: the sections' pydantic models live in zerodp.config.monitor: csv_monitor, tensorboard, wandb, ...)
  event.py           one event (DeepSpeed's names, x = samples seen) and what a writer provides
  csv_monitor.py     one CSV file per event;  tensorboard.py  SummaryWriter scalars;  wandb.py  wandb.log
  comms_logger.py    count, bytes and latency of every collective (observes comm/collectives.py)
  flops_profiler.py  one step's FLOPs with torch.utils.flop_counter, and the achieved FLOP/s
  monitor.py         the object the engine calls at forward, backward, step and close

Only the config models are imported here, so `zerodp.config` can import them without loading the rest.

    memory_report.py  Measuring the model-state bytes a rank holds, next to the ZeRO paper's prediction for them.
    model_states.py   The bytes of model states one rank holds at each ZeRO stage, by design: the paper's formula.
    tensorboard.py    `tensorboard`: the monitor's events as TensorBoard scalars in <output_path>/<job_name>.
    wandb.py          `wandb`: the monitor's events logged to Weights & Biases (never a dependency of zerodp).
"""

from ..config.monitor import CommsLoggerConfig, CSVMonitorConfig, FlopsProfilerConfig, TensorBoardConfig, WandbConfig

__all__ = ["CommsLoggerConfig", "CSVMonitorConfig", "FlopsProfilerConfig", "TensorBoardConfig", "WandbConfig"]
