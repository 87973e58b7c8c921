"""comm/topology.py without a process group: the node layout read from torchrun's environment."""

from __future__ import annotations

import pytest

from zerodp.comm import topology


@pytest.mark.parametrize("env, want", [
    ({}, topology.NodeLayout(1, 1, True)),  # no torchrun: one node of the (one-rank) world
    ({"LOCAL_WORLD_SIZE": "1", "RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0"}, topology.NodeLayout(1, 1, True)),
    ({"LOCAL_WORLD_SIZE": "1", "RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "3"}, topology.NodeLayout(1, 1, False)),
])
def test_node_layout_from_torchrun_environment(monkeypatch, env, want):
    for key in ("LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert topology.node_layout() == want


def test_one_process_never_crosses_nodes():
    assert topology.crosses_nodes(None) is False
