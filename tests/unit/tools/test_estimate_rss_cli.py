"""`zerodp estimate --peak-rss | --config | --fit-memory` in process, with the baseline given (no subprocess)."""

from __future__ import annotations

import json
import re

import pytest

from zerodp.tools import cli


def run_main(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def _peak_mib(out: str) -> float:
    value, unit = re.search(r"predicted before launch: ([0-9.]+) (MiB|GiB)", out).groups()
    return float(value) * (1024 if unit == "GiB" else 1)


def test_peak_rss_of_the_default_job_adds_its_terms_to_the_given_baseline(capsys):
    code, out, _ = run_main(capsys, "estimate", "--model", "small", "--peak-rss", "--baseline-rss", "300MiB")
    assert code == 0, out
    rows = {r[1].strip(): r[2].strip() for r in (line.split("|") for line in out.splitlines())
            if len(r) > 3 and r[1].strip() not in ("term", "---")}
    assert rows["baseline"] == "300.0 MiB"
    assert {"parameters", "gradients", "optimizer states", "activations", "heap retention"} <= set(rows)
    total = sum(float(v.split()[0]) * (1024 if v.endswith("GiB") else 1) for v in rows.values())
    assert _peak_mib(out) == pytest.approx(total, abs=0.1 * len(rows))
    assert "stage 3, 2 rank(s), no offload" in out


def test_a_config_file_sets_stage_and_offload(capsys, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}))
    code, out, _ = run_main(capsys, "estimate", "--params", "201M", "--layers", "48", "--world-size", "2",
                            "--precision", "fp32", "--config", str(config), "--baseline-rss", "300MiB")
    assert code == 0, out
    assert "offload_optimizer nvme, offload_param nvme" in out and "optimizer I/O windows" in out
    assert "heap retention" not in out and "in files under nvme_path: 1.61 GB" in out
    plain_code, plain, _ = run_main(capsys, "estimate", "--params", "201M", "--layers", "48", "--world-size", "2",
                                    "--precision", "fp32", "--peak-rss", "--baseline-rss", "300MiB")
    assert plain_code == 0 and _peak_mib(plain) > 3 * _peak_mib(out)


def test_fit_memory_names_a_config_that_fits_and_says_why(capsys):
    code, out, _ = run_main(capsys, "estimate", "--params", "3e9", "--layers", "37", "--world-size", "2",
                            "--precision", "fp32", "--fit-memory", "8GiB", "--baseline-rss", "300MiB")
    assert code == 0, out
    chosen = re.search(r"cheapest that fits: (.+?), predicted peak ([0-9.]+) GiB <= 8.00 GiB; (.+)", out)
    assert chosen and float(chosen.group(2)) <= 8 and "need more" in chosen.group(3)
    section = json.loads(out.split("zero_optimization: ")[1].splitlines()[0])
    assert section["stage"] == 3 and section["offload_param"]["device"] == "nvme"
    assert "nvme_path needs 24.00 GB free per rank" in out  # 3e9 x 16 B / 2 ranks: fp32 Adam states in files


def test_fit_memory_says_when_nothing_fits(capsys):
    code, out, _ = run_main(capsys, "estimate", "--model", "small", "--fit-memory", "100MiB",
                            "--baseline-rss", "300MiB")
    assert code == 1 and "nothing fits 100.0 MiB" in out


def test_gpt_overrides_the_presets_shape(capsys):
    code, out, _ = run_main(capsys, "estimate", "--model", "small", "--gpt", "n_layer=8", "--peak-rss",
                            "--baseline-rss", "300MiB")
    # 3,253,760 parameters plus 4 blocks of 12 C^2 + 9 C at C = 256
    assert code == 0 and f"GPT small with n_layer=8: {3_253_760 + 4 * (12 * 256**2 + 9 * 256):,} parameters" in out


def test_train_batch_size_alone_gives_the_micro_batch(capsys, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3}}))
    code, out, _ = run_main(capsys, "estimate", "--model", "small", "--config", str(config), "--world-size", "4",
                            "--baseline-rss", "300MiB")
    assert code == 0 and "micro-batch 2 x 128 tokens" in out  # 8 sequences over 4 ranks
    config.write_text(json.dumps({"train_batch_size": 9, "zero_optimization": {"stage": 3}}))
    code, _, err = run_main(capsys, "estimate", "--model", "small", "--config", str(config), "--baseline-rss", "1GiB")
    assert code == 2 and "not divisible" in err


@pytest.mark.parametrize("argv, message", [
    (["--paper", "--peak-rss"], "need --model or --params"),
    (["--params", "1e9", "--peak-rss"], "needs --layers L"),
    (["--model", "small", "--layers", "4", "--peak-rss"], "describe a --params model"),
    (["--params", "1e9", "--layers", "4", "--gpt", "n_layer=2", "--peak-rss"], "--gpt overrides"),
    (["--model", "small", "--gpt", "depth=3", "--peak-rss"], "KEY one of"),
    (["--model", "small", "--fit-memory", "lots"], "--fit-memory: cannot read the size"),
    (["--model", "small", "--baseline-rss", "1GiB"], "add --peak-rss"),
    (["--model", "small", "--peak-rss", "--stage", "2", "--offload-param", "nvme", "--baseline-rss", "1GiB"],
     "--offload-param needs stage 3"),
    (["--params", "3e8", "--layers", "1", "--world-size", "2", "--offload-param", "nvme", "--offload", "nvme", "--stage", "3",
      "--peak-rss", "--baseline-rss", "1GiB"], "buffer_size=100000000 elements cannot hold a shard"),
    (["--model", "small", "--peak-rss", "--stage", "0", "--offload", "nvme", "--baseline-rss", "1GiB"],
     "offload_optimizer needs stage 1, 2 or 3"),
])
def test_mistakes_are_one_line_naming_the_fix(capsys, argv, message):
    code, out, err = run_main(capsys, "estimate", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
