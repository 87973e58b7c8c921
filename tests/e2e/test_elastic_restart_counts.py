"""The exact condition of an elastic restart on two nodes, made deterministic (issue 41, part 3): torch's agents
keep one store for the whole job, and after a worker on node A dies, A's agent starts its new workers with
TORCHELASTIC_RESTART_COUNT=1 while node B's agent starts its own with 0. Here the test plays both agents: it serves
the job's store, starts 4 ranks (2 "nodes" x 2) for a first attempt, then 4 new ranks whose restart counts differ
by node, as torchrun gives them. Every rank of the second attempt must form one group with the others (an
all-reduce over the 4 ranks) instead of reading the first attempt's dead addresses ("connectFullMesh ...
Connection refused") or waiting under another prefix than its peers (a hang). The full run with torchrun, kill -9
and a bitwise comparison: tests/e2e/test_elastic_nodes.py (slow)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

WORKER = """
import torch, torch.distributed as dist
from zerodp import comm
comm.init_distributed(timeout_s=40)
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():g}", flush=True)
comm.destroy_distributed()
"""


def _attempt(port: int, restart_counts: list[int]) -> list[tuple[int, str]]:
    """4 ranks on 2 'nodes' with torchrun's variables and the given per-rank restart counts; (exit code, output)."""
    procs = []
    for rank, count in enumerate(restart_counts):
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", RANK=str(rank), WORLD_SIZE="4",
                   LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="counts-test",
                   TORCHELASTIC_RESTART_COUNT=str(count), TORCHELASTIC_MAX_RESTARTS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += "\n(hung: killed after 120 s)"
        results.append((proc.returncode, out))
    return results


@pytest.mark.timeout(300)
def test_ranks_whose_agents_counted_differently_still_form_one_group_on_the_jobs_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agents' job-long store
    first = _attempt(store.port, [0, 0, 0, 0])
    assert [code for code, _ in first] == [0] * 4, first
    assert all(f"rank {r} sum 10" in out for r, (_, out) in enumerate(first)), first
    # node A's worker died: A's agent counts 1 restart, B's agent restarts its workers with the count 0
    second = _attempt(store.port, [1, 1, 0, 0])
    assert [code for code, _ in second] == [0] * 4, second
    assert all(f"rank {r} sum 10" in out for r, (_, out) in enumerate(second)), second
