"""`zerodp train` end to end: real ranks, a few steps of the tiny GPT, then a resume; and under torchrun.

The first run takes the default stage (3), the resume switches to stage 2 (a checkpoint reshards to
any stage), and the torchrun case uses stage 1, so each way of sharding runs through the real job.

Each case starts real processes through the real entry points (a fresh interpreter importing torch per
rank is most of the cost), so the cases are few and the runs short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TINY = ["--model", "tiny", "--micro-batch", "4", "--seq-len", "32", "--log-every", "4"]


def zerodp(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def metric_steps(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(240)
def test_train_then_resume(tmp_path):
    out = tmp_path / "run"
    proc = zerodp("train", *TINY, "--nproc", "2", "--steps", "8", "--out", str(out))
    rows = metric_steps(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, [r["loss"] for r in rows]
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header == ["step", "loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "step_time_s", "rss_bytes"]
    assert "zerodp train summary: stage 3, 2 rank(s)" in proc.stdout  # the default stage
    assert "step     8/8" in proc.stdout and "sample (top-" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for r in summary["ranks"]:  # fp32 Adam over 2 ranks: gradients and optimizer states are halved
        assert r["grads_bytes"] == pytest.approx(r["grads_bytes_predicted"], rel=0.01)
        assert r["optimizer_bytes"] == pytest.approx(r["optimizer_bytes_predicted"], rel=0.01)
        assert r["optimizer_bytes"] == pytest.approx(4 * r["numel"], rel=0.01)  # 2 states x 4 B x Psi / 2
        # parameters: Psi/2 each, plus the units small enough to stay whole on every rank
        expected = 4 * r["numel"] / 2 + r["persistent_param_bytes"] / 2
        assert r["params_bytes"] == pytest.approx(expected, rel=0.01)
    assert summary["run"]["val_loss"] is not None and summary["run"]["tokens_per_s"] > 0
    try:
        import matplotlib  # noqa: F401  (the [plot] extra)
        assert (out / "loss.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in proc.stdout
    checkpoint = summary["run"]["checkpoint"]
    if checkpoint is None:
        pytest.skip(f"no checkpoint to resume from: {summary['run']['checkpoint_note']}")
    assert os.path.isdir(checkpoint)

    # Resume: the settings come from run.json, the step counter continues, metrics are appended.
    proc = zerodp("train", "--resume", str(out), "--steps", "12", "--stage", "2")
    assert "resumed at step 8" in proc.stdout and "zerodp train summary: stage 2, 2 rank(s)" in proc.stdout
    rows = metric_steps(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert json.loads((out / "summary.json").read_text())["run"]["first_step"] == 9
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.timeout(180)
def test_runs_under_torchrun_without_launching_again(tmp_path):
    out = tmp_path / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "zerodp", "train", *TINY, "--stage", "1", "--steps", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("zerodp train summary: stage 1, 2 rank(s)") == 1  # rank 0 only, one world of 2
    assert [r["step"] for r in metric_steps(out)] == [1, 2, 3]


@pytest.mark.slow  # `make test-slow`: kept out of `make test` for its 15-minute budget
@pytest.mark.timeout(240)
def test_offloaded_bf16_stage3_resume_equals_the_uninterrupted_run(tmp_path):
    """Issue 23: `zerodp train` saves and loads through the engine, checked on the hardest case: bf16, stage 3,
    both offloads on nvme given as a user writes them (device and nvme_path only), through --config. A run of 4
    steps saves at step 2 (--save-every 2) and at its end; a fresh launch resumes from global_step2 into another
    folder. Steps 3-4 must be the uninterrupted run's bitwise, and so must the final checkpoint's shard files
    (fp32 masters, Adam moments, loss scale, RNG states): a state dropped by the offloaded save or load shows."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offload = {"device": "nvme", "nvme_path": str(nvme)}
    config = tmp_path / "offload.json"
    # persistence threshold and unit size small enough that the tiny GPT (120k parameters) is sharded into more
    # units than the offload's default working set (buffer_count 5 shards), so shards are written back to their
    # files and read again between uses (the defaults of 100k keep it all whole: nothing offloaded but Adam)
    config.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 64, "stage3_unit_min_params": 2000,
        "offload_param": offload, "offload_optimizer": offload}}))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    zerodp("train", *TINY, "--config", str(config), "--nproc", "2", "--steps", "4", "--save-every", "2",
           "--out", str(whole))
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["run"]["precision"] == "bf16" and summary["run"]["stage"] == 3
    for r in summary["ranks"]:  # both offloads in effect: per owned element, Adam's 2 fp32 moments and the
        # bf16 parameter shard live in the nvme files, and no unit stays whole in memory
        assert r["disk_bytes"] >= (8 + 2) * r["owned_numel"] > 0, r
        assert r["persistent_param_bytes"] == 0, r
    proc = zerodp("train", "--resume", str(whole / "checkpoints"), "--tag", "global_step2", "--out", str(resumed))
    assert "resumed at step 2" in proc.stdout, proc.stdout
    keys = ("step", "loss", "lr", "grad_norm", "loss_scale")
    uninterrupted = [{k: r[k] for k in keys} for r in metric_steps(whole)]
    assert [r["step"] for r in uninterrupted] == [1, 2, 3, 4]
    # step 3 runs on the parameters loaded at the resume point: its loss and gradient norm are theirs
    assert [{k: r[k] for k in keys} for r in metric_steps(resumed)] == uninterrupted[2:]  # bitwise
    tag = "checkpoints/global_step4"
    files = sorted(p.name for p in (whole / tag).iterdir() if p.suffix == ".safetensors" or p.name.startswith("rng"))
    assert len(files) == 5, files  # 2 shard files, the model-state file, 2 RNG files
    for name in files:
        assert (whole / tag / name).read_bytes() == (resumed / tag / name).read_bytes(), name
    assert not any(nvme.iterdir()), "engine.close() left offload files behind"
