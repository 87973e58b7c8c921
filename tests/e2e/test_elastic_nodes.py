"""Elastic restart across nodes under c10d (issue 41, part 3): two torchrun agents on this machine act as two
nodes (`--nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --max_restarts 1`); a worker of the second node is
killed with SIGKILL mid-run; both nodes' workers restart, agree on the attempt (comm/elastic_attempt.py: the
healthy node's agent gives its workers TORCHELASTIC_RESTART_COUNT=0), resume from the newest complete checkpoint,
and end with bitwise the parameters of an uninterrupted two-node run. Once for `zerodp train`, once for the
README's own-script restart pattern (tests/e2e/elastic_script.py). Harness: tests/e2e/elastic_nodes.py, which
also runs either case many times in a row.

Each case is two full two-node runs of 4 ranks on 2 shared cores (~1-2 minutes): marked slow.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.elastic_nodes import STEPS, equal_params, final_params, run_nodes


def _both_exit_0(run) -> None:
    assert run.codes == [0, 0], "\n".join(f"--- exit {c}\n{o[-2000:]}\n{e[-4000:]}" for c, o, e in run.results)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", [False, True], ids=["zerodp-train", "readme-script"])
def test_kill_9_on_one_of_two_c10d_nodes_restarts_both_and_matches_bitwise(tmp_path, script):
    reference = run_nodes(tmp_path / "uninterrupted", script, kill_after=None)
    _both_exit_0(reference)

    run = run_nodes(tmp_path / "killed", script, kill_after=2)
    assert run.killed_at is not None and 2 <= run.killed_at < STEPS, run.killed_at  # mid-run, after checkpoints
    _both_exit_0(run)
    if script:  # every rank started again from a checkpoint, none from step 0
        starts = [int(s) for s in re.findall(r"started at step (\d+)", run.stdout)]
        assert len(starts) == 4 and all(2 <= s < STEPS for s in starts), (starts, run.stdout)
    else:  # rank 0 (on either node) says it restarted, from a periodic checkpoint
        restarted = re.search(r"restarted \(restart 1 of 1\) after a rank failed; resuming from step (\d+)",
                              run.stdout)
        assert restarted, run.stdout
        assert 2 <= int(restarted.group(1)) < STEPS
        assert "already holds a run" not in "".join(e for _, _, e in run.results)
    assert equal_params(final_params(tmp_path / "uninterrupted", script), final_params(tmp_path / "killed", script)) \
        == []  # bitwise, not approximately
