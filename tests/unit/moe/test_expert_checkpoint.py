"""moe/checkpoint.py's packed-expert pieces: joined in expert order whatever order the files were read in; pieces
stepped a different number of times stay apart (they load at the expert-parallel size they were saved with) and are
refused, naming the tensor, at another size."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerodp.errors import CheckpointError
from zerodp.moe import checkpoint
from zerodp.moe.checkpoint import _cut_packed, _join_packed


def _piece(first: int, step: float) -> dict:
    value = torch.arange(2 * 3, dtype=torch.float32).view(2, 3) + 100 * first
    return {"value": value, "state": {"momentum_buffer": -value}, "scalars": {"step": torch.tensor(step)},
            "step": None}


def _engine_holding(first: int, count: int, monkeypatch):
    """An engine whose module has one packed parameter `w` holding experts first .. first+count-1."""
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(count, 3))
    monkeypatch.setattr(checkpoint, "_packed_pieces", lambda plan: {id(module.w): (first, count)})
    return SimpleNamespace(module=module)


def test_pieces_are_joined_in_expert_order():
    entries = {"w#experts2": _piece(2, 5.0), "w#experts0": _piece(0, 5.0), "dense": {"x": 1}}
    whole = _join_packed(entries)["w"]
    assert torch.equal(whole["value"], torch.cat([_piece(0, 5.0)["value"], _piece(2, 5.0)["value"]]))
    assert torch.equal(whole["state"]["momentum_buffer"], -whole["value"])


def test_a_rank_at_another_size_gets_its_experts_cut_from_the_joined_tensor(monkeypatch):
    entries = _join_packed({"w#experts0": _piece(0, 5.0), "w#experts2": _piece(2, 5.0)})
    _cut_packed(entries, _engine_holding(1, 1, monkeypatch), None, "ckpt")  # expert 1 alone (EP 4)
    assert torch.equal(entries["w#experts1"]["value"], _piece(0, 5.0)["value"][1:2])


def test_pieces_stepped_differently_load_at_their_own_size_and_are_refused_at_another(monkeypatch):
    entries = _join_packed({"w#experts0": _piece(0, 5.0), "w#experts2": _piece(2, 4.0)})
    assert "w" not in entries
    _cut_packed(entries, _engine_holding(2, 2, monkeypatch), None, "ckpt")  # the size it was saved with: as saved
    assert torch.equal(entries["w#experts2"]["value"], _piece(2, 4.0)["value"])
    with pytest.raises(CheckpointError, match="pieces of w were stepped a different number of times"):
        _cut_packed(entries, _engine_holding(1, 1, monkeypatch), None, "ckpt")
