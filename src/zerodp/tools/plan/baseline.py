"""The framework's own RSS on this machine, measured once: `baseline_rss_bytes`.

A rank's RSS starts well above its model: the interpreter, torch's libraries, zerodp, a gloo
process group and the autograd engine's first backward take about 320 MiB on a CPU-only Linux
machine (torch 2.13), more than the model states of anything below ~20M parameters. It depends on
the machine and the installed versions, not on the model, so it is measured, not modelled:

    a fresh `python` subprocess imports torch and zerodp, starts a one-rank gloo group, trains a
    two-layer model for two steps through `zerodp.initialize` at stage 3, and reports its peak RSS
    (VmHWM, Linux; ru_maxrss elsewhere), with OMP_NUM_THREADS=1 as zerodp's ranks run.

The result is cached as JSON in `$ZERODP_CACHE_DIR` (default `~/.cache/zerodp`), keyed by the
python, torch and zerodp versions and the host name, so `zerodp estimate` measures it the first
time only (a few seconds); `zerodp estimate --calibrate` measures it again.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

CACHE_FILE = "baseline_rss.json"

# Run in the subprocess: the smallest complete training process (its peak RSS is the baseline).
_PROBE = r"""
import os, resource, sys, tempfile
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
import zerodp
init = "file://" + os.path.join(tempfile.mkdtemp(), "rdzv")
dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()),
                           {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}})
for _ in range(2):
    engine.backward(F.mse_loss(engine(torch.ones(4, 64)), torch.zeros(4, 64)))
    engine.step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
try:
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
except OSError:
    pass
engine.close()
print("BASELINE_RSS", peak, flush=True)
os._exit(0)
"""


class BaselineError(RuntimeError):
    """The baseline could not be measured (the probe failed); the message says why and what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("ZERODP_CACHE_DIR") or Path.home() / ".cache" / "zerodp")


def _key() -> dict:
    import torch

    from ... import __version__

    return {"python": platform.python_version(), "torch": torch.__version__, "zerodp": __version__,
            "host": socket.gethostname(), "machine": platform.machine()}


def measure_baseline_rss(timeout_s: float = 300.0) -> int:
    """Peak RSS in bytes of the probe process (module docstring); raises BaselineError on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[2])  # this zerodp, even when it is not the installed one
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with tempfile.TemporaryDirectory() as cwd:
        try:
            done = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=cwd, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BaselineError(f"measuring the baseline RSS took over {timeout_s:.0f} s; retry on a less loaded "
                                f"machine, or pass --baseline-rss BYTES") from None
    for line in done.stdout.splitlines():
        if line.startswith("BASELINE_RSS "):
            return int(line.split()[1])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise BaselineError(f"measuring the baseline RSS failed (exit {done.returncode}: {tail}); pass --baseline-rss "
                        f"BYTES to give it yourself")


def baseline_rss_bytes(recalibrate: bool = False) -> tuple[int, str]:
    """(baseline bytes, where it came from): the cached measurement for this machine and versions, else a
    new one, cached. `recalibrate` measures again."""
    path = cache_dir() / CACHE_FILE
    key = _key()
    if not recalibrate and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key and int(cached["bytes"]) > 0:
                return int(cached["bytes"]), f"measured {cached.get('when', 'earlier')}, cached in {path}"
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache is measured again and rewritten
    measured = measure_baseline_rss()
    import time

    when = time.strftime("%Y-%m-%d %H:%M")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "bytes": measured, "when": when}, indent=1) + "\n")
        where = f"measured now, cached in {path}"
    except OSError as err:
        where = f"measured now (not cached: {err.strerror} writing {path})"
    return measured, where
