"""The benchmark harness (`python -m bench.harness`, in the checkout, outside the installed package) runs
peers and stages side by side and reports whether their losses equal DDP's (a smoke run on the tiny model;
no timing is asserted). `zerodp bench` says where the harness went."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the harness's own runs (26 s): `make test-slow`, so `make test` keeps within 15 minutes
@pytest.mark.timeout(300)
def test_bench_reports_identical_losses_to_ddp(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, "-m", "bench.harness", "--model", "tiny", "--steps", "2",
                           "--rounds", "1", "--strategies", "ddp", "zerodp1", "zerodp3",
                           "--out", str(tmp_path / "runs"), "--results", str(results)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in results.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| strategy")}
    assert set(rows) == {"ddp", "zerodp1", "zerodp3"}
    for name in ("zerodp1", "zerodp3"):
        assert rows[name].rstrip().endswith("| identical |"), rows[name]
    assert (tmp_path / "runs" / "chart.png").stat().st_size > 0


@pytest.mark.slow  # as above (10 s)
@pytest.mark.timeout(300)
def test_interleaved_bench_steps_every_strategy_in_one_process_pair(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, "-m", "bench.harness", "--interleaved", "--model", "tiny",
                           "--steps", "3", "--strategies", "ddp", "fsdp1_full", "zerodp2", "zerodp3",
                           "--out", str(tmp_path / "runs"), "--results", str(results)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in results.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| strategy")}
    assert set(rows) == {"ddp", "fsdp1_full", "zerodp2", "zerodp3"}
    assert float(rows["ddp"][3]) == 1.0  # each step's ratio is to DDP's same step
    for name in ("zerodp2", "zerodp3"):  # built from the same seed in the same process, they train alike
        assert rows[name][5].strip() == "identical", rows[name]
    import json
    [rank0, rank1] = json.loads((tmp_path / "runs" / "interleaved.json").read_text())
    assert all(len(rank0["step_times"][n]) == 3 for n in rows)
    assert rank0["losses"] == rank1["losses"]


def test_zerodp_bench_names_the_harness_command():
    proc = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", "bench", "--model", "tiny"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "python -m bench.harness --model tiny" in proc.stderr, proc.stderr


def test_the_installed_package_has_no_benchmark_harness():
    import zerodp

    assert not (Path(zerodp.__file__).parent / "bench").exists()
