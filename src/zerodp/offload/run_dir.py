"""The folder that holds one rank's offload files: nvme_path/zerodp-<run id>/rank<r>/.

zerodp creates it, sizes the files in it, and removes it when the owner is closed or the process
exits normally (a `weakref.finalize`, which also runs at interpreter exit). Each rank folder holds
`owner.json` (host and pid); a folder whose owner process is gone is a leftover of a crashed run: it
is reported with its size, never reused (every run has a fresh run id) and never deleted behind the
user's back.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
import warnings
import weakref
from pathlib import Path

PREFIX = "zerodp-"
OWNER_FILE = "owner.json"


class OffloadPathError(ValueError):
    """An nvme_path that cannot hold zerodp's files; the message names the key and the fix."""


def new_run_id() -> str:
    """A fresh id (rank 0 makes it; every rank uses rank 0's)."""
    return uuid.uuid4().hex[:12]


def check_nvme_path(nvme_path: str, key: str, needed_bytes: int) -> None:
    """Raise OffloadPathError unless `nvme_path` is an existing, writable directory with room for
    `needed_bytes` (checked before any file is created)."""
    path = Path(nvme_path)
    if not path.exists():
        raise OffloadPathError(f"{key}={nvme_path!r} does not exist; create the directory or point {key} at one")
    if not path.is_dir():
        raise OffloadPathError(f"{key}={nvme_path!r} is not a directory; point {key} at a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadPathError(f"{key}={nvme_path!r} is not writable by this process; fix its permissions or "
                               f"choose another directory")
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise OffloadPathError(f"{key}={nvme_path!r} has {free / 2**30:.2f} GiB free but this run needs "
                               f"{needed_bytes / 2**30:.2f} GiB on its file system; free space or choose a larger "
                               f"disk")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def find_leftovers(nvme_path: str) -> list[tuple[Path, int]]:
    """Rank folders under nvme_path whose owner on this host is gone: (folder, bytes)."""
    out = []
    host = socket.gethostname()
    for run in sorted(Path(nvme_path).glob(PREFIX + "*")):
        for rank_dir in sorted(run.glob("rank*")):
            try:
                owner = json.loads((rank_dir / OWNER_FILE).read_text())
            except (OSError, ValueError):
                owner = {}
            if owner.get("host") == host and _pid_alive(int(owner.get("pid", -1))):
                continue  # a live run (maybe another job) owns it
            if owner.get("host") not in (None, host):
                continue  # another machine's folder on a shared disk: not ours to judge
            out.append((rank_dir, _folder_bytes(rank_dir)))
    return out


def report_leftovers(nvme_path: str) -> None:
    """Warn once about leftover folders of crashed runs (they are never reused or deleted)."""
    leftovers = find_leftovers(nvme_path)
    if leftovers:
        listing = ", ".join(f"{p} ({n / 2**20:.1f} MiB)" for p, n in leftovers[:5])
        warnings.warn(f"offload folders left by a crashed run under {nvme_path}: {listing}"
                      f"{' ...' if len(leftovers) > 5 else ''}; zerodp does not reuse them: delete them to free "
                      f"the space", UserWarning, stacklevel=2)


def _remove(path: str, run_dir: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(run_dir)  # the run folder goes with its last rank folder
    except OSError:
        pass


class RankDir:
    """This rank's offload folder; files inside are created by `path_of`. Removed by `close()` or at exit."""

    def __init__(self, nvme_path: str, run_id: str, rank: int) -> None:
        self.run_dir = Path(nvme_path) / f"{PREFIX}{run_id}"
        self.path = self.run_dir / f"rank{rank}"
        if self.path.exists():
            raise OffloadPathError(f"offload folder {self.path} already exists; zerodp never reuses a folder: "
                                   f"delete it")
        self.path.mkdir(parents=True)
        (self.path / OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self._finalizer = weakref.finalize(self, _remove, str(self.path), str(self.run_dir))

    def path_of(self, name: str) -> Path:
        return self.path / name

    def disk_bytes(self) -> int:
        """Bytes the files in this folder occupy on disk (allocated blocks)."""
        return sum(f.stat().st_blocks * 512 for f in self.path.iterdir() if f.is_file()) if self.path.exists() else 0

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the folder and its files now."""
        self._finalizer()
