"""A model built on the CPU is moved to its rank's GPU under NCCL, by `zerodp.initialize`, the DeepSpeed
adapter and `init_context` (issue 31 item 6; zerodp/comm/module_device.py), decided as data and checked on CPU:
device values for the decision, the meta device standing in for a GPU for the move."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import zerodp
import zerodp.engine.zero_engine as engine_mod
from zerodp import comm
from zerodp.comm import module_device
from zerodp.config import load_config
from zerodp.adapters.deepspeed import forward_engine
init_context_mod = importlib.import_module("zerodp.shard.stage3.init_context")  # the module, not the function


def test_the_rule_as_data():
    assert module_device.training_device("nccl", 0) == torch.device("cuda", 0)
    assert module_device.training_device("nccl", 3) == torch.device("cuda", 3)
    # DeepSpeed's init_distributed(dist_backend="cpu:gloo,cuda:nccl") names the group so (dist.get_backend)
    assert module_device.training_device("cpu:gloo,cuda:nccl", 0) == torch.device("cuda", 0)
    assert module_device.training_device("cpu:gloo", 0) is None
    assert module_device.training_device("gloo", 0) is None  # a CPU run changes in nothing
    assert module_device.training_device("none", 0) is None  # no process group: where the script put it


def test_rank_device_reads_the_groups_backend_and_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(comm, "backend_name", lambda group=None: "nccl")
    assert module_device.rank_training_device() == torch.device("cuda", 3)
    monkeypatch.setattr(comm, "backend_name", lambda group=None: "gloo")
    assert module_device.rank_training_device() is None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.norm = nn.BatchNorm1d(4)  # buffers: running statistics
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter in two modules


def test_move_keeps_every_parameter_object_for_the_optimizer():
    model = Net()
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    model.embed.weight.grad = torch.ones(5, 4)
    moved = module_device.move_cpu_tensors(model, torch.device("meta"))  # meta: a device other than the CPU
    assert moved == 3 + 3  # embed (tied once), norm weight and bias; running mean, var, count
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    assert model.embed.weight.grad.device.type == "meta"
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in params}
    assert model.head.weight is model.embed.weight
    assert module_device.move_cpu_tensors(model, torch.device("meta")) == 0  # nothing left on the CPU


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_place_module_moves_only_under_nccl(monkeypatch, backend):
    seen = []
    monkeypatch.setattr(comm, "backend_name", lambda group=None: backend)
    monkeypatch.setattr(module_device, "move_cpu_tensors", lambda model, device: seen.append(device))
    monkeypatch.setenv("LOCAL_RANK", "1")
    module_device.place_module(Net())
    assert seen == ([torch.device("cuda", 1)] if backend == "nccl" else [])


def test_initialize_places_the_model_and_a_cpu_run_is_unchanged(monkeypatch):
    calls = []
    real = engine_mod.place_module
    monkeypatch.setattr(engine_mod, "place_module", lambda model, group=None: calls.append(model) or real(model, group))
    model = nn.Linear(3, 2)
    weight = model.weight
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_optimization": {"stage": 1}})
    try:
        assert calls == [model]
        assert model.weight is weight and weight.device.type == "cpu"  # no NCCL group: nothing moved
    finally:
        engine.close()


def test_deepspeed_forward_engine_at_stage3_places_the_model(monkeypatch):
    calls = []
    monkeypatch.setattr(forward_engine, "place_module", lambda model, group=None: calls.append(model))
    model = nn.Sequential(nn.Linear(3, 2))
    eng = forward_engine.ForwardEngine(model, load_config({"zero_optimization": {"stage": 3}}))
    try:
        assert calls == [model]
    finally:
        eng.close()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_init_context_makes_slices_on_the_ranks_device(monkeypatch, backend):
    monkeypatch.setattr(comm, "backend_name", lambda group=None: backend)
    monkeypatch.setenv("LOCAL_RANK", "0")
    ctx = init_context_mod._InitContext(None, 0, torch.float32)
    assert ctx.device == (torch.device("cuda", 0) if backend == "nccl" else None)
    offloaded = init_context_mod._InitContext(None, 0, torch.float32, param_home=object())
    assert offloaded.device is None  # offload_param: slices live in their offloaded home on the host
