"""`make bench-gpu` (bench/gpu_bench.py) stays runnable: one strategy of its --tiny mode, in its own process as
the benchmark runs it, trains and reports; a failing run is reported, not fatal."""

import math

import pytest

from bench import gpu_bench


@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_tiny_run_of_one_strategy_reports_its_figures():
    row = gpu_bench.run_child("zerodp3", "tiny", tiny_steps=True, timeout_s=120)
    assert "error" not in row, row.get("error")
    assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["tflops"] > 0
    assert len(row["losses"]) == 3 and all(math.isfinite(x) for x in row["losses"])
    assert row["params"] == sum(p.numel() for p in __import__("zerodp.tools.models.gpt", fromlist=["GPT"]).GPT(
        gpu_bench.model_config("tiny")).parameters())
    failed = {"strategy": "fsdp2", "size": "tiny", "error": "RuntimeError: out of memory"}
    text = gpu_bench.table([row, failed])
    assert "| tiny | zerodp3 |" in text and "failed: RuntimeError: out of memory" in text
