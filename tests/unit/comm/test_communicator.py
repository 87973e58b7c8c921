"""Which new communicators wait for every member (comm/communicator.py): those with gloo on CPU tensors, which
connect at creation; not NCCL ones, which connect at their first collective, nor one-rank groups. No process
group: torch's answers are monkeypatched (the multi-rank behaviour is tests/dist/test_communicator.py)."""

from __future__ import annotations

import pytest
import torch

from zerodp.comm import communicator
from zerodp.comm.backend import gloo_serves_cpu


@pytest.mark.parametrize("backend, expected", [
    ("gloo", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl,cpu:gloo", True),
    ("nccl", False), ("cuda:gloo,cpu:nccl", False), ("mpi", False)])
def test_gloo_serves_cpu_reads_torchs_backend_names(backend, expected):
    assert gloo_serves_cpu(backend) is expected


@pytest.mark.parametrize("backend, world, issued", [("gloo", 2, 1), ("cpu:gloo,cuda:nccl", 4, 1), ("nccl", 2, 0),
                                                    ("gloo", 1, 0)])
def test_wait_for_members_is_one_cpu_all_reduce_where_gloo_connects(monkeypatch, backend, world, issued):
    calls = []
    monkeypatch.setattr(communicator.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(communicator.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(communicator.dist, "all_reduce", lambda t, group=None: calls.append((t.device, group)))
    communicator.wait_for_members("the group")
    assert calls == [(torch.device("cpu"), "the group")] * issued
