"""The `zerodp` command line: help, errors, `estimate` against the paper's Table 1 (in process, fast)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zerodp.tools import cli
from zerodp.tools.plan import render_paper_table
from zerodp.tools.app.train_args import TrainArgs


def run_main(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:  # argparse's --help and usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def totals(output: str) -> dict[int, str]:
    """stage -> the total column of `zerodp estimate`'s table."""
    rows = [line.split("|") for line in output.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return {int(r[1]): r[-2].strip() for r in rows}


def test_help_lists_commands_and_options(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    for command in ("train", "estimate", "consolidate"):
        assert command in out
    code, out, _ = run_main(capsys, "train", "--help")
    assert code == 0
    for option in ("--config", "--stage", "--nproc", "--steps", "--model", "--micro-batch", "--seq-len", "--lr",
                   "--precision", "--resume", "--out", "--log-every", "--seed", "torchrun"):
        assert option in out, option
    code, out, _ = run_main(capsys, "estimate", "--help")
    assert code == 0 and "--params" in out and "--world-size" in out and "--paper" in out


@pytest.mark.parametrize("argv, expected", [
    (["--params", "7.5e9", "--world-size", "64"], {0: "120", 1: "31.4", 2: "16.6", 3: "1.88"}),
    (["--params", "128B", "--world-size", "64"], {0: "2048", 1: "536", 2: "284", 3: "32"}),
    (["--params", "1T", "--world-size", "1024", "--stage", "3"], {3: "15.6"}),
])
def test_estimate_reproduces_paper_table_1(capsys, argv, expected):
    code, out, err = run_main(capsys, "estimate", *argv)
    assert code == 0, err
    assert "(GB)" in out
    assert totals(out) == expected


def test_estimate_paper_prints_table_1(capsys):
    code, out, _ = run_main(capsys, "estimate", "--paper")
    assert code == 0
    assert render_paper_table([7.5e9, 128e9, 1e12], [1, 4, 16, 64, 256, 1024]) in out
    assert "| 64 | 31.4 | 16.6 | 1.88 | 536 | 284 | 32 | 4187 | 2218 | 250 |" in out


def test_estimate_model_falls_with_stage_and_shows_activations(capsys):
    code, out, _ = run_main(capsys, "estimate", "--model", "small", "--world-size", "2")
    assert code == 0
    got = {stage: float(v) for stage, v in totals(out).items()}
    # fp32 Adam, N=2: (4+4+8) Psi, then (4+4) Psi + 8 Psi/2, 4 Psi + 12 Psi/2, 16 Psi/2 (MB).
    assert got[0] > got[1] > got[2] > got[3] == pytest.approx(got[0] / 2, rel=0.01)
    assert "activations per rank" in out and "assumes" in out


@pytest.mark.parametrize("argv, needle", [
    (["train", "--model", "huge"], "invalid choice"),
    (["train", "--resume", "/nonexistent/run"], "no such directory"),
    (["train", "--stage", "2", "--seq-len", "999"], "block_size"),
    (["estimate", "--params", "lots"], "not a number"),
    (["estimate"], "required"),
    (["consolidate", "/nonexistent/ckpt", "out.safetensors"], "no such checkpoint folder"),
])
def test_user_mistakes_are_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert "Traceback" not in err


@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_bad_config_is_one_line_and_exit_2(tmp_path):
    """Through the real entry point: a misspelt key, one line naming it, exit code 2, no rank started."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stag": 2}, "train_batch_size": 7}))
    proc = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", "train", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("zerodp: error:") and "'stag'" in lines[0] and "did you mean 'stage'" in lines[0]


def test_batch_that_does_not_divide_the_world_is_a_config_error(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train_batch_size: 7\nzero_optimization:\n  stage: 1\n")
    code, _, err = run_main(capsys, "train", "--config", str(cfg), "--nproc", "2")
    assert code == 2 and "train_batch_size=7" in err and len(err.strip().splitlines()) == 1


def test_more_ranks_than_cores_is_a_warning(monkeypatch, capsys):
    import torch.distributed.launcher.api as launcher_api

    from zerodp.tools.app import train

    launched = {}
    monkeypatch.setattr(launcher_api, "elastic_launch",
                        lambda config, entry: lambda args: launched.update(n=config.nproc_per_node) or {0: {}})
    monkeypatch.setattr(train.os, "cpu_count", lambda: 1)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    args = TrainArgs(nproc=2, steps=1, model="tiny", seq_len=8, lr=1e-3, seed=0, log_every=1, out="x",
                     precision="fp32", config={})
    train.launch(args)
    assert launched == {"n": 2}
    assert "warning: --nproc 2 is more than the 1 CPU core" in capsys.readouterr().err


def test_options_override_config_file_and_defaults(tmp_path, monkeypatch):
    from zerodp.tools.app.train_args import resolve_train_args

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the default --nproc without a GPU: 2
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000},
                               "bf16": {"enabled": True}}))
    opts = dict.fromkeys(cli.TRAIN_OPTIONS)
    args = resolve_train_args({**opts, "config": str(cfg), "stage": 2, "model": "tiny", "out": "o"})
    assert args.config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert args.precision == "bf16" and args.seq_len == 64 and args.nproc == 2
    assert args.config["train_micro_batch_size_per_gpu"] == 8 and args.config["gradient_clipping"] == 1.0
    args = resolve_train_args({**opts, "config": str(cfg), "precision": "fp32", "model": "tiny", "out": "o"})
    assert args.precision == "fp32" and args.config["zero_optimization"]["stage"] == 1


def test_learning_rate_schedule():
    from zerodp.tools.app.train import lr_at

    lrs = [lr_at(s, 100, 1.0) for s in range(100)]
    assert lrs[0] == pytest.approx(0.2) and lrs[4] == pytest.approx(1.0)  # 5 warm-up steps
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # then never rises
    assert lr_at(100, 100, 1.0) == pytest.approx(0.1)


def test_python_m_zerodp_train_is_the_train_command(capsys, monkeypatch):
    import runpy

    monkeypatch.setattr(sys, "argv", ["zerodp", "train", "--help"])
    try:
        runpy.run_module("zerodp", run_name="__main__")  # `python -m zerodp train`, as torchrun -m runs it
    except SystemExit as exit_:
        assert exit_.code == 0
    assert "usage: zerodp train" in capsys.readouterr().out
