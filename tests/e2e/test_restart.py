"""No lost run (issue 13): kill -9 of a rank during `zerodp train --max-restarts 1 --save-every 5`
restarts every rank from the newest complete checkpoint and ends with bitwise the same parameters
as an uninterrupted run (fp32; the data order is a function of the step)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import zerodp
from tests.e2e.test_train import TINY, metric_steps, zerodp as run_zerodp

STEPS = 20
ARGS = [*TINY, "--nproc", "2", "--stage", "2", "--steps", str(STEPS), "--save-every", "5"]


def _ranks(launcher_pid: int) -> list[psutil.Process]:
    """The rank processes the launcher started (multiprocessing spawn children, not its resource tracker)."""
    children = psutil.Process(launcher_pid).children(recursive=True)
    return [p for p in children if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in
            " ".join(p.cmdline())]


def _steps_logged(out) -> int:
    try:
        return len(metric_steps(out))
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.timeout(300)
def test_kill_9_of_a_rank_restarts_from_the_newest_checkpoint_and_matches(tmp_path):
    reference = tmp_path / "uninterrupted"
    run_zerodp("train", *ARGS, "--out", str(reference), timeout=150)

    out = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "zerodp.tools.cli", "train", *ARGS, "--max-restarts", "1",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 150
        while _steps_logged(out) < 7:  # past the first periodic checkpoint (step 5)
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
            time.sleep(0.02)
        victim = _ranks(proc.pid)[-1]
        os.kill(victim.pid, signal.SIGKILL)  # a real kill -9, mid-training
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    restarted = re.search(r"restarted \(restart 1 of 1\) after a rank failed; resuming from step (\d+)", stdout)
    assert restarted, stdout
    assert int(restarted.group(1)) in (5, 10, 15), restarted.group(0)  # a periodic checkpoint's step
    assert "step    20/20" in stdout
    assert [r["step"] for r in metric_steps(out)][-1] == STEPS

    expected = zerodp.consolidate_checkpoint(reference / "checkpoints")
    got = zerodp.consolidate_checkpoint(out / "checkpoints")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name  # bitwise, not approximately
    # Rotation: the newest two periodic checkpoints and the final one, never more.
    tags = sorted(p.name for p in (reference / "checkpoints").iterdir() if p.is_dir() and p.name[0] != ".")
    assert tags == ["global_step10", "global_step15", "global_step20"], tags
