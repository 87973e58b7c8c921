"""No silent hang: a stalled rank, ranks that diverge, and ranks with different models are each named
within seconds (real torchrun jobs, see divergence_job.py)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("divergence_job.py")
TIMEOUT_S = 8  # divergence_job.py's comm_timeout_s: long enough for a loaded machine's scheduling


def run_job(mode: str) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(JOB), mode], capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.timeout(300)
def test_a_stalled_rank_is_reported_within_the_timeout():
    code, out, seconds = run_job("stall")
    assert code != 0
    # far below gloo's own 30 minutes; generous for torchrun's start-up on a loaded 2-core machine (the
    # watchdog's message below is what proves zerodp, not the backend, ended the run)
    assert seconds < TIMEOUT_S + 150, f"took {seconds:.0f} s"
    assert f"(comm_timeout_s={TIMEOUT_S})" in out and "zerodp rank 0: waited" in out, out[-3000:]
    assert "global step 2" in out and "phase forward" in out and "unit '" in out, out[-3000:]
    assert "last 32 collectives" in out


@pytest.mark.timeout(300)
def test_debug_sync_names_the_unit_where_ranks_diverge():
    code, out, _ = run_job("extra")
    assert code != 0
    assert "ranks are about to issue different collectives" in out, out[-3000:]
    assert "unit 'extra'" in out, out[-3000:]
    assert "rank 0 refused" in out and "rank 1 refused" in out


@pytest.mark.timeout(300)
def test_ranks_with_different_models_refuse_to_start():
    code, out, _ = run_job("models")
    assert code != 0
    assert "ranks built different models" in out and "blocks.0.weight" in out, out[-3000:]
    assert "rank 0 refused" in out and "rank 1 refused" in out
