"""DeepSpeed engine calls the collected scripts make beyond the training loop (zerodp/adapters/deepspeed/engine.py):
`engine.compile()` (DeepSpeed's tests/torch_compile), `offload_states` / `reload_states` / `destroy`
(DeepSpeedExamples' training/offload_states) with `deepspeed.runtime.zero.offload_config`'s enums, and which
inputs the adapter casts (DeepSpeed: only fp16 with auto_cast). The adapter engine wraps a stand-in for
zerodp's engine here (no process group): these calls only read its module and optimizer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from zerodp.config import ConfigError
from zerodp.deepspeed import _casts_inputs
from zerodp.deepspeed.engine import DeepSpeedEngine
from zerodp.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum


def _adapter(model: torch.nn.Module) -> DeepSpeedEngine:
    inner = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    inner.step()  # Adam's state (exp_avg, exp_avg_sq) now exists, on the parameters' device
    closed = []
    zero = SimpleNamespace(module=model, optimizer=SimpleNamespace(optimizer=inner), lr_scheduler=None, train_batch_size=4,
                           close=lambda: closed.append(True), closed=closed,
                           compile=lambda **kwargs: model.compile(**kwargs))  # ZeroEngine.compile, stages 0-2
    return DeepSpeedEngine(zero)


def test_offload_config_enums_have_deepspeeds_names_and_values():
    assert [e.value for e in OffloadDeviceEnum] == ["none", "cpu", "nvme"]
    assert [e.name for e in OffloadStateTypeEnum] == ["optim_states", "hp_params", "lp_params", "lp_grads",
                                                      "contiguous_grad_buffer"]
    assert OffloadStateTypeEnum["optim_states"] == "optim_states"  # str enums: compare equal to their value


def test_offload_states_on_cpu_moves_nothing_and_refuses_what_deepspeed_refuses():
    model = torch.nn.Linear(3, 2)
    engine = _adapter(model)
    before = {n: (p.data_ptr(), p.device) for n, p in model.named_parameters()}
    state = engine.optimizer.optimizer.state[model.weight]["exp_avg"]
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states], device=OffloadDeviceEnum.cpu)
    engine.reload_states()
    # already in CPU memory: the same storages, untouched
    assert {n: (p.data_ptr(), p.device) for n, p in model.named_parameters()} == before
    assert engine.optimizer.optimizer.state[model.weight]["exp_avg"] is state
    with pytest.raises(ValueError, match="NVMe is not supported for offloading states"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match="'optim_state' is not a valid OffloadStateTypeEnum"):
        engine.offload_states(include=["optim_state"])
    engine.offload_states(device="none")  # DeepSpeed: nothing to do


def test_offload_states_refuses_states_on_a_gpu(monkeypatch):
    engine = _adapter(torch.nn.Linear(3, 2))
    monkeypatch.setattr(DeepSpeedEngine, "_state_devices", lambda self: {"cpu", "cuda"})
    with pytest.raises(NotImplementedError, match=r"moving states from \['cuda'\] to CPU memory .* not implemented"):
        engine.offload_states()


def test_destroy_closes_zerodps_engine():
    engine = _adapter(torch.nn.Linear(3, 2))
    engine.destroy()
    assert engine.engine.closed == [True]


def test_compile_compiles_the_module_in_place_once():
    model = torch.nn.Linear(3, 2)
    engine = _adapter(model)
    x = torch.randn(4, 3)
    want = model(x)
    assert not engine.is_compiled
    engine.compile(backend="eager")
    assert engine.is_compiled and model._compiled_call_impl is not None  # module.compile's in-place wrapper
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)  # the eager backend runs the same kernels
    engine.compile(backend="eager")  # a second call is a no-op, as in DeepSpeed
    with pytest.raises(ConfigError, match="DeepCompile, which zerodp does not implement"):
        _adapter(torch.nn.Linear(3, 2)).compile(schedule=[(0, [])])


def test_inputs_are_cast_only_where_deepspeed_casts_them(tmp_path):
    assert not _casts_inputs({"bf16": {"enabled": True}})
    assert not _casts_inputs({"fp16": {"enabled": True}})  # auto_cast defaults to false in DeepSpeed
    assert _casts_inputs({"fp16": {"enabled": True, "auto_cast": True}})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True, "auto_cast": True}}))
    assert _casts_inputs(str(path)) and not _casts_inputs({})
