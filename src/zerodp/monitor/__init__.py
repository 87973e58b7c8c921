"""Monitoring, as DeepSpeed's config sections ask for it (see monitor.py for what is written when):

  config.py          the sections' pydantic models: csv_monitor, tensorboard, wandb, comms_logger, flops_profiler
  event.py           one event (DeepSpeed's names, x = samples seen) and what a writer provides
  csv_monitor.py     one CSV file per event;  tensorboard.py  SummaryWriter scalars;  wandb.py  wandb.log
  comms_logger.py    count, bytes and latency of every collective (observes comm/collectives.py)
  flops_profiler.py  one step's FLOPs with torch.utils.flop_counter, and the achieved FLOP/s
  monitor.py         the object the engine calls at forward, backward, step and close

Only the config models are imported here, so `zerodp.config` can import them without loading the rest.
"""

from ..config.monitor import CommsLoggerConfig, CSVMonitorConfig, FlopsProfilerConfig, TensorBoardConfig, WandbConfig

__all__ = ["CommsLoggerConfig", "CSVMonitorConfig", "FlopsProfilerConfig", "TensorBoardConfig", "WandbConfig"]
