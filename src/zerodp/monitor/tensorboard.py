"""`tensorboard`: the monitor's events as TensorBoard scalars in <output_path>/<job_name>.

Uses torch.utils.tensorboard.SummaryWriter, which needs the `tensorboard` package (an optional
extra: `pip install tensorboard` or `pip install zerodp[monitor]`). Flushed after every step's events,
as DeepSpeed does, so a crash loses nothing already logged.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..config.monitor import TensorBoardConfig
from .event import Event


def check_tensorboard() -> None:
    """Refuse, on every rank, a tensorboard section that cannot be honoured."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"tensorboard.enabled is true but the tensorboard package is missing ({err}); run `pip "
                          f"install tensorboard` (or zerodp[monitor]) or set tensorboard.enabled false") from None


class TensorBoardMonitor:
    """A SummaryWriter over the job's folder (rank 0 only builds one)."""

    def __init__(self, config: TensorBoardConfig) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(config.output_path or ".") / config.job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write_events(self, events: list[Event]) -> None:
        for event in events:
            self.writer.add_scalar(event.name, event.value, event.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
