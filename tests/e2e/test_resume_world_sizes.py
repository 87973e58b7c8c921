"""README: `zerodp train --resume` continues "at any stage or rank count". A checkpoint written by 2
ranks resumes on 1, 2 and 3 (2->1, 2->3, against 2->2), and one written by 1 rank on 2 (1->2, against
1->1); the micro-batch is chosen so that the global batch stays 6 sequences, so every continuation
trains on the same data and its losses must equal the same-world continuation's. Tolerance: fp32
summation order across a different number of ranks (rtol 1e-5 on losses of order 1).
"""

from __future__ import annotations

import pytest

from tests.e2e.test_train import metric_steps, zerodp

BASE = ["--model", "tiny", "--seq-len", "32", "--log-every", "100", "--stage", "3"]
MICRO = {1: "6", 2: "3", 3: "2"}  # x ranks = 6 sequences per step at every world size


def train(out, nproc: int, steps: int, resume=None) -> list[float]:
    argv = [*BASE, "--nproc", str(nproc), "--micro-batch", MICRO[nproc], "--steps", str(steps), "--out", str(out)]
    proc = zerodp("train", *argv, *(["--resume", str(resume)] if resume else []), timeout=200)
    if resume:
        assert f"{nproc} rank(s)" in proc.stdout and "resumed at step" in proc.stdout, proc.stdout
    return [r["loss"] for r in metric_steps(out)]


@pytest.mark.slow  # `make test-slow`: kept out of `make test` for its 15-minute budget
@pytest.mark.timeout(600)
def test_resume_at_another_world_size_continues_the_same_run(tmp_path):
    train(tmp_path / "two", 2, 3)
    from_two = {n: train(tmp_path / f"two-to-{n}", n, 5, resume=tmp_path / "two" / "checkpoints") for n in (1, 2, 3)}
    for n in (1, 3):
        assert len(from_two[n]) == 2, from_two[n]  # steps 4 and 5 only: it continued, not restarted
        assert from_two[n] == pytest.approx(from_two[2], rel=1e-5), f"2 -> {n} ranks: {from_two[n]} vs {from_two[2]}"
    train(tmp_path / "one", 1, 3)
    from_one = {n: train(tmp_path / f"one-to-{n}", n, 5, resume=tmp_path / "one" / "checkpoints") for n in (1, 2)}
    assert from_one[2] == pytest.approx(from_one[1], rel=1e-5), f"1 -> 2 ranks: {from_one[2]} vs {from_one[1]}"
