"""Multi-node (issue 13): two torchrun agents on this machine act as two nodes (--nnodes 2, c10d
rendezvous on localhost) running `zerodp train` train bitwise the parameters that 1 node x 2 ranks
trains, and the checkpoint that 2 nodes x 1 rank saved resumes on 1 node x 2 ranks.

Also here: a failure inside a rank reaches the user as one line, exit 2, with torch's launcher
report kept in launcher.log and the saved run untouched (a resume with the wrong model)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

import zerodp
from tests.e2e.multinode_check import TINY, free_port as _free_port
from tests.e2e.test_train import metric_steps, zerodp as run_zerodp


@pytest.mark.slow  # 27 s: make test-slow (CI runs it), keeping make test under 15 minutes
@pytest.mark.timeout(900)  # four launches, each with its own timeout
def test_two_nodes_then_resume_on_one_node_with_two_ranks(tmp_path):
    out = tmp_path / "two-nodes"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id",
                               f"zerodp-test-{port}", "--max_restarts", "0", "-m", "zerodp", "train", *TINY,
                               "--steps", "4", "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [node.communicate(timeout=200) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, results):
        assert node.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr[-3000:]}"
    stdout = "".join(r[0] for r in results)
    assert stdout.count("zerodp train summary: stage 3, 2 rank(s)") == 1, stdout  # one world of 2 ranks
    assert [r["step"] for r in metric_steps(out)] == [1, 2, 3, 4]

    # The two nodes trained exactly what one node with two ranks trains.
    reference = tmp_path / "one-node"
    run_zerodp("train", *TINY, "--nproc", "2", "--steps", "4", "--out", str(reference), timeout=150)
    expected = zerodp.consolidate_checkpoint(reference / "checkpoints")
    got = zerodp.consolidate_checkpoint(out / "checkpoints")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name

    # 2 nodes x 1 rank saved it; 1 node x 2 ranks continues it.
    proc = run_zerodp("train", "--resume", str(out), "--nproc", "2", "--steps", "6", timeout=150)
    assert "resumed at step 4" in proc.stdout and "zerodp train summary: stage 3, 2 rank(s)" in proc.stdout
    assert [r["step"] for r in metric_steps(out)] == [1, 2, 3, 4, 5, 6]

    # A failure inside the ranks: resuming with another model. One line, exit 2, the report in a file.
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    proc = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", "train", "--resume", str(out), "--model", "small",
                           "--steps", "8"], capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerodp: error: rank "), proc.stderr
    assert "CheckpointError" in lines[0] and f"full report: {out}/launcher.log" in lines[0]
    assert "ChildFailedError" in (out / "launcher.log").read_text()
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    assert {p: d for p, d in after.items() if p.name != "launcher.log"} == \
        {p: d for p, d in before.items() if p.name != "launcher.log"}
