"""`csv_monitor`: one CSV file per event name, as DeepSpeed's csvMonitor lays them out.

    <output_path>/<job_name>/Train_Samples_lr.csv      step,lr
                                                       64,0.001
The file name is the event name with '/' and ' ' replaced by '_'; the header is `step` and the last
component of the name. Files are appended to (a resumed run continues them); the header is written
only to a new or empty file.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from ..config.monitor import CSVMonitorConfig
from .event import Event


class CSVMonitor:
    """Appends each event to its CSV file (rank 0 only builds one)."""

    def __init__(self, config: CSVMonitorConfig) -> None:
        self.log_dir = Path(config.output_path or ".") / config.job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def path_of(self, name: str) -> Path:
        return self.log_dir / (name.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, events: list[Event]) -> None:
        for event in events:
            path = self.path_of(event.name)
            new = not path.exists() or os.path.getsize(path) == 0
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", event.name.rsplit("/", 1)[-1]])
                writer.writerow([event.step, repr(float(event.value))])  # repr: the float, digit for digit

    def close(self) -> None:
        pass
