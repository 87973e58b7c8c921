"""Ctrl-C in `zerodp train` (docs/troubleshooting.md, "When things go wrong"): a real SIGINT to the whole process
group, as a terminal sends it, after the first checkpoint. The run says where to continue from and
exits 130; the resume it names continues from that checkpoint's step.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.e2e.test_train import TINY, metric_steps, zerodp


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


@pytest.mark.timeout(300)
def test_ctrl_c_after_a_checkpoint_exits_130_and_the_resume_continues(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Many steps, a checkpoint every 2: the run is still training when the signal arrives.
    proc = subprocess.Popen([sys.executable, "-m", "zerodp.tools.cli", "train", *TINY, "--nproc", "2", "--steps", "5000",
                             "--save-every", "2", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    stdout, deadline = [], time.monotonic() + 200
    try:
        while time.monotonic() < deadline:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                break
            stdout.append(line)
            if line.startswith("checkpoint: "):
                break
        assert stdout and stdout[-1].startswith("checkpoint: "), "".join(stdout) + proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        stderr = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 130, f"exit {code}\n{stderr[-3000:]}"
    assert f"zerodp: interrupted; continue from the newest checkpoint with --resume {out}" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]

    saved = sorted(int(m.group(1)) for m in (re.fullmatch(r"global_step(\d+)", p.name)
                                             for p in (out / "checkpoints").iterdir()) if m)
    assert saved, "no checkpoint on disk"
    resumed = zerodp("train", "--resume", str(out), "--steps", str(saved[-1] + 2))
    assert f"resumed at step {saved[-1]}" in resumed.stdout, resumed.stdout
    steps = [r["step"] for r in metric_steps(out)]
    assert steps[-2:] == [saved[-1] + 1, saved[-1] + 2], steps[-5:]
