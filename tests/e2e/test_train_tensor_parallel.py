"""`zerodp train --tp 2` end to end (2 ranks: tensor-parallel 2 x data-parallel 1): the tensor-parallel GPT
trains, each rank's parameter bytes in the summary are its share (the sharded matrices halved, the replicated
parameters whole), periodic checkpoints are written and rotated per tensor-parallel rank, a resume continues
it, and a resume at another tensor-parallel size is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.test_train import TINY, metric_steps, zerodp
from zerodp.tools.models.gpt import MODEL_PRESETS
from zerodp.tools.models.tp_gpt import TensorParallelGPT
from zerodp.tensor_parallel import tensor_parallel_specs


def share_of_one_rank(tp: int) -> int:
    """Parameter elements one tensor-parallel rank of the tiny GPT holds: sharded ones / tp, replicated whole."""
    model = TensorParallelGPT(MODEL_PRESETS["tiny"], seed=0)
    specs = tensor_parallel_specs(model)
    return sum(p.numel() // tp if name in specs else p.numel() for name, p in model.named_parameters())


@pytest.mark.slow  # 27 s: make test-slow (CI runs it), keeping make test under 15 minutes
@pytest.mark.timeout(240)
def test_train_with_tensor_parallelism(tmp_path):
    out = tmp_path / "run"
    proc = zerodp("train", *TINY, "--tp", "2", "--nproc", "2", "--stage", "1", "--steps", "5", "--save-every", "1",
                  "--out", str(out))
    assert "zerodp train summary: stage 1, 2 rank(s) = tensor-parallel 2 x data-parallel 1" in proc.stdout
    rows = metric_steps(out)
    assert [r["step"] for r in rows] == list(range(1, 6)) and rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    share = share_of_one_rank(2)
    assert share < 0.6 * TensorParallelGPT(MODEL_PRESETS["tiny"]).num_parameters()
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for r in summary["ranks"]:  # fp32, one data-parallel rank: ZeRO shards nothing, each rank holds its share
        assert r["params_bytes"] == 4 * share and r["optimizer_bytes"] == 8 * share
    assert 4 * share // 1024 == 244  # docs/cli.md: 244 KiB per rank at --tp 2 (the whole tiny model: 469 KiB)
    # periodic checkpoints rotate in both tensor-parallel folders (the newest 2 and the final one are kept)
    for t in range(2):
        tags = sorted(p.name for p in (out / "checkpoints" / f"tp-0{t}-of-02").iterdir() if p.is_dir())
        assert tags == ["global_step3", "global_step4", "global_step5"], tags
    resumed = zerodp("train", "--resume", str(out), "--steps", "6")
    assert "resumed at step 5" in resumed.stdout and metric_steps(out)[-1]["step"] == 6
    refused = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", "train", "--resume", str(out), "--steps", "7",
                              "--tp", "1"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "saved at tensor-parallel size 2; resume with --tp 2" in refused.stderr
