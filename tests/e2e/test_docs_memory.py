"""docs/memory.md's promises: its command examples print what the page shows, its accuracy table is
bench/results/estimate_rss.md's, every case there is within 15%, and those predictions are what the
code predicts today (so a change to the model that breaks the 15% fails here, not in a later bench)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from zerodp.tools import cli
from zerodp.tools.plan import peak_rss

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "memory.md").read_text()
RESULTS = (ROOT / "bench" / "results" / "estimate_rss.md").read_text()


def _examples() -> list[tuple[list[str], list[str]]]:
    """(argv, expected lines) of each ```$ zerodp ...``` block; '...' stands for lines not shown."""
    out = []
    for block in re.findall(r"```\n(\$ zerodp .*?)```", DOC, re.S):
        command, *lines = block.strip().splitlines()
        out.append((shlex.split(command[2:])[1:], lines))
    return out


@pytest.mark.parametrize("argv, expected", _examples(), ids=lambda v: " ".join(v[:4]) if isinstance(v, list) and
                         v and v[0] == "estimate" else None)
def test_the_pages_examples_print_what_it_shows(capsys, argv, expected):
    code = cli.main(argv)
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    if "..." in expected:
        shown = [line for line in expected if line != "..."]
        assert all(line in out for line in shown), "\n".join(out)
    else:
        assert out == expected


def _table(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| (")]


def test_the_accuracy_table_is_the_bench_results_and_every_case_is_within_15_percent():
    rows = _table(RESULTS)
    assert rows and _table(DOC) == rows, "docs/memory.md's table differs from bench/results/estimate_rss.md"
    baseline = re.search(r"Baseline ([0-9.]+) MiB", RESULTS).group(1)
    assert f"baseline ({baseline} MiB)" in DOC.replace("\n", " "), "the page states another baseline than the results"
    assert {r[0] for r in rows} == {"(a) make train", "(a) make train, re-run", "(b) 201M MLP, no offload", "(b) 201M MLP, both offloads nvme",
                                    "(c) 3e9 GPT, both offloads nvme", "(d) 8.4M MLP, no offload",
                                    "(d) 8.4M MLP, both offloads nvme", "(d) 8.4M MLP, stage 1, no offload",
                                    "(d) 8.4M MLP, stage 2, no offload"}
    for case, rank, measured, predicted, ratio, ok in rows:
        assert abs(float(predicted) / float(measured) - 1) <= 0.15 and ok == "yes", (case, rank)


def test_the_recorded_predictions_are_todays_model():
    sys.path.insert(0, str(ROOT))
    from bench import estimate_rss as bench

    baseline = round(float(re.search(r"Baseline ([0-9.]+) MiB", RESULTS).group(1)) * 2**20)
    predicted = {r[0]: float(r[3]) for r in _table(RESULTS)}
    cases = [bench.case_train(baseline, None), bench.case_train(baseline, None, rerun=True), bench.case_201m(baseline, "none", False),
             bench.case_201m(baseline, "both", False), bench.case_3b(baseline),
             bench.case_small(baseline, "none", False), bench.case_small(baseline, "both", False),
             bench.case_small(baseline, "none", False, 1), bench.case_small(baseline, "none", False, 2)]
    for label, _, peak, *_ in cases:
        assert peak.total / 2**20 == pytest.approx(predicted[label], abs=0.1), label


def test_the_fitted_constants_are_the_ones_the_page_states():
    assert f"{peak_rss.HEAP_RETENTION_STATES} x the model states in RAM" in DOC.replace("\n  ", " ")
    assert f"{peak_rss.HEAP_RETENTION_ACTIVATIONS} x the activations" in DOC.replace("\n  ", " ")


def test_the_baseline_is_measured_once_cached_and_measured_again_with_calibrate(capsys, tmp_path, monkeypatch):
    """The page's promise about the baseline: a subprocess measures it the first time, later estimates read
    the cache, --calibrate measures again (a real probe: ~5 s)."""
    monkeypatch.setenv("ZERODP_CACHE_DIR", str(tmp_path))
    argv = ["estimate", "--model", "tiny", "--peak-rss"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert f"measured now, cached in {tmp_path}" in first
    measured = float(re.search(r"\| baseline \| ([0-9.]+) MiB", first).group(1))
    assert 100 < measured < 4096, "a python + torch process is hundreds of MiB"
    assert cli.main(argv) == 0
    assert "cached in" in (second := capsys.readouterr().out) and "measured now" not in second
    assert cli.main(argv + ["--calibrate"]) == 0
    assert "measured now" in capsys.readouterr().out
