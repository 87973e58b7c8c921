"""What the user sees when a rank of `zerodp train` fails: one line, with the long report in a file.

torch's elastic launcher reports a failed rank with 40-120 lines of log records and tracebacks.
`launcher_log` sends the launcher's log records (and, on failure, its full report) to
`<out>/launcher.log` instead of the terminal; `failure_line` turns the report into the one line the
user reads: which rank, the exception's own message (zerodp's errors already name the fix), and
where the full report is. A user mistake found inside a rank (a zerodp error class) exits 2, as
mistakes caught before launch do; a crash or a signal exits 1.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

from ..app.run_folder import LAUNCHER_LOG

# Exceptions whose message is a user mistake with its fix (exit code 2, as before launch).
USER_ERRORS = ("CheckpointError", "ConfigError", "UsageError", "RunFolderError", "OptimizerError",
               "PartitionedParameterError")
# The loggers torch's launcher and its process helpers write to.
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


@contextlib.contextmanager
def launcher_log(out: Path) -> Iterator[Path]:
    """Within the block, the launcher's log records go to `out/launcher.log`, not to the terminal."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LAUNCHER_LOG
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in _LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False  # torch's own handler (on the "torch" logger) would print to stderr
    try:
        yield path
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()


def failure_line(err, log_path: Path) -> tuple[int, str]:
    """(exit code, one line) for torch's ChildFailedError; its full report is appended to `log_path`."""
    with open(log_path, "a") as log:
        log.write(f"torch's launcher report ({type(err).__name__}):\n{err}\n")
    rank, failure = err.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = " ".join(str(message).split())  # one line, whatever the exception's text held
    where = f"(full report: {log_path})"
    if failure.signal_name() != "<N/A>":
        return 1, (f"rank {rank} was killed by {failure.signal_name()} (out of memory, or killed from outside?); "
                   f"pass --max-restarts N to restart from the newest checkpoint {where}")
    if not message or message.startswith("To enable traceback"):
        return 1, f"rank {rank} exited with code {failure.exitcode} {where}"
    code = 2 if message.split(":", 1)[0] in USER_ERRORS else 1
    return code, f"rank {rank}: {message} {where}"
