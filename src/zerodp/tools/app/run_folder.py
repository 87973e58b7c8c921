"""The output folder of a `zerodp train` run: what may be written there, and how a run comes back.

One folder (`--out`) holds one run: `run.json` (its settings), the metrics files, the summary, the
plot, the sample, the launcher's log and `checkpoints/`. This module owns the rules about it:

- A folder that already holds a run is never silently reused: a new run there is refused unless
  the user continues it (`--resume`) or replaces it (`--overwrite`, which removes only the files a
  run writes, never anything else in the folder).
- The folder must be writable, checked before any rank starts (not discovered after training).
- Periodic checkpoints (`--save-every K`) rotate: a run keeps its newest `KEEP_CHECKPOINTS`, so a
  long run does not fill the disk; the final checkpoint and other runs' tags are never removed.
- After a rank dies, torch's elastic agent restarts every rank (`--max-restarts N`, or torchrun's
  `--max_restarts` on every node) and `restart_checkpoint` names the newest complete checkpoint of
  this run to resume from. Because the data order is a function of the step, the restarted run
  ends with the same parameters as an uninterrupted one. On several nodes each agent counts its
  own restarts (TORCHELASTIC_RESTART_COUNT is 0 on a node whose workers did not fail), so the
  restart and the job come from what every rank agreed on (comm/elastic_attempt.py), and run.json
  records the job: a restarted attempt on any node knows the folder as its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from ...checkpoint.format import LATEST_FILE, available_tags
from ...comm import elastic_attempt

CHECKPOINTS_DIR = "checkpoints"
LAUNCHER_LOG = "launcher.log"
# What a run writes into its folder: --overwrite removes exactly these.
RUN_FILES = ("run.json", "metrics.jsonl", "metrics.csv", "summary.json", "sample.txt", "loss.png", LAUNCHER_LOG)
KEEP_CHECKPOINTS = 2


class RunFolderError(Exception):
    """An --out folder that cannot be used; the message names the fix (a usage error)."""


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's ranks (0 on the first attempt), as every rank
    of every node agrees on it (comm/elastic_attempt.py); without a job-long store, the local agent's count.
    Under torch's elastic agent this is collective: every rank calls it."""
    attempt = elastic_attempt.current()
    if attempt is not None:
        return attempt.index
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def this_job() -> Optional[str]:
    """The elastic job this process runs in, the same in all its attempts (None outside torch's agent store)."""
    attempt = elastic_attempt.current()
    return None if attempt is None else attempt.job_id


def holds_this_job(out: Path) -> bool:
    """True when `out`'s run was started by this elastic job (an earlier attempt of it wrote run.json)."""
    job = this_job()
    if job is None:
        return False
    try:
        return json.loads((out / "run.json").read_text()).get("job") == job
    except (OSError, ValueError, AttributeError):
        return False


def previous_run(out: Path) -> list[str]:
    """The files and folders of an earlier run found in `out` (empty when there is none)."""
    if not out.is_dir():
        return []
    found = [name for name in RUN_FILES if (out / name).exists()]
    # Dot files are other ranks' write probes and unfinished saves, not a run.
    if (out / CHECKPOINTS_DIR).is_dir() and any(not p.name.startswith(".") for p in (out / CHECKPOINTS_DIR).iterdir()):
        found.append(CHECKPOINTS_DIR + "/")
    return found


def prepare(out: Path, continuing: bool, overwrite: bool) -> None:
    """Check `out` before any rank starts: refuse to mix two runs, clear it on --overwrite, check writable.

    `continuing`: this run continues the one in `out` (a --resume of it, or an elastic restart).
    """
    found = previous_run(out)
    if found and not continuing:
        if not overwrite:
            raise RunFolderError(f"--out {out} already holds a run ({', '.join(found)}); pass --resume {out} to "
                                 f"continue it, --overwrite to replace it, or another --out")
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / CHECKPOINTS_DIR, ignore_errors=True)
    check_writable(out / CHECKPOINTS_DIR)


def check_writable(folder: Path) -> None:
    """Prove a file can be written in `folder`; raise RunFolderError if not. Leaves no trace: folders
    it had to create for the probe are removed again (the run creates them when it writes)."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise RunFolderError(f"cannot write to {folder} ({err.strerror or err}); choose a writable --out or fix "
                             f"the folder's permissions") from None
    finally:
        for created in missing:  # deepest first
            with contextlib.suppress(OSError):
                created.rmdir()


def restart_checkpoint(out: Path) -> Optional[Path]:
    """The checkpoints folder of this run when it holds a complete checkpoint to restart from."""
    ckpt = out / CHECKPOINTS_DIR
    return ckpt if (ckpt / LATEST_FILE).is_file() and available_tags(ckpt) else None


class CheckpointRotation:
    """Rank 0's record of the periodic checkpoints this launch saved; keeps the newest `keep`."""

    def __init__(self, ckpt_dir: Path, keep: int = KEEP_CHECKPOINTS) -> None:
        self.ckpt_dir, self.keep = ckpt_dir, keep
        self.saved: list[str] = []

    def add(self, path: str) -> None:
        """Record a committed checkpoint and remove this launch's ones beyond the newest `keep`."""
        self.saved.append(Path(path).name)
        while len(self.saved) > self.keep:
            old = self.saved.pop(0)
            # with --tp each tensor-parallel rank keeps its checkpoints in a tp-XX-of-YY folder of its own
            for folder in [self.ckpt_dir, *self.ckpt_dir.glob("tp-*-of-*")]:
                shutil.rmtree(folder / old, ignore_errors=True)
