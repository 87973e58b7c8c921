"""`zerodp.deepspeed.accelerator`: each method the collected scripts call answers as DeepSpeed 0.19.8's
CPU_Accelerator (the values observed in the bench venv with DS_ACCELERATOR=cpu) and CUDA_Accelerator
(its source: cuda_accelerator.py), the CUDA answers checked through a stand-in for torch.cuda."""

from __future__ import annotations

import types

import pytest
import torch

from zerodp.adapters.deepspeed import accelerator as acc_mod
from zerodp.deepspeed.accelerator import Accelerator, get_accelerator


def test_cpu_answers_as_deepspeeds_cpu_accelerator(monkeypatch):
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    a = Accelerator("cpu")
    assert (a.device_name(), a.device_name(1), a.current_device_name()) == ("cpu", "cpu", "cpu")
    assert a.communication_backend_name() == "gloo" and a.device_count() == 1 and a.is_available()
    assert a.current_device() == 0 and a.device(0) is None
    assert a.set_device(1) is None and a.synchronize() is None and a.empty_cache() is None
    assert a.Stream is None and a.Event is None and a.current_stream() is None
    with a.stream(None):
        pass
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())  # DeepSpeed's CPU test (False on this VM)
    assert a.is_bf16_supported() is True and a.is_fp16_supported() is fp16
    assert a.supported_dtypes() == [torch.float32] + [torch.half] * fp16 + [torch.bfloat16]
    t = torch.zeros(3)
    assert a.on_accelerator(t) and a.pin_memory(t) is t and not a.is_pinned(t)
    assert not a.on_accelerator(torch.zeros(1, device="meta"))
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert a.device_count() == 4  # DeepSpeed's CPU device count is LOCAL_SIZE when set


def test_cpu_seed_and_rng_are_torchs():
    a = Accelerator("cpu")
    a.manual_seed_all(5)
    x = torch.rand(2)
    a.manual_seed(5)
    assert torch.equal(torch.rand(2), x) and a.initial_seed() == 5
    state = a.get_rng_state()
    y = torch.rand(2)
    a.set_rng_state(state)
    assert torch.equal(torch.rand(2), y)


def test_cpu_memory_is_the_process_rss():
    import psutil

    a = Accelerator("cpu")
    a.reset_peak_memory_stats()
    rss = psutil.Process().memory_info().rss
    assert abs(a.memory_allocated() - rss) < 64 * 2 ** 20 and a.memory_reserved() > 0
    block = torch.ones(32 * 2 ** 20 // 4)  # 32 MiB touched: the peak follows the RSS up
    assert a.max_memory_allocated() >= a.memory_allocated() - 2 ** 20 > 0
    del block
    assert a.total_memory() == psutil.virtual_memory().total and 0 < a.available_memory() <= a.total_memory()
    assert set(a.memory_stats()) == {"allocated_bytes.all.current", "allocated_bytes.all.peak"}


def _fake_cuda(capability=(8, 0), available=True):
    calls = []
    fake = types.SimpleNamespace(
        current_device=lambda: 3, device_count=lambda: 4, is_available=lambda: available,
        set_device=lambda i: calls.append(("set_device", i)), synchronize=lambda i=None: calls.append(("sync", i)),
        manual_seed=lambda s: calls.append(("seed", s)), manual_seed_all=lambda s: calls.append(("seed_all", s)),
        Stream="StreamClass", Event="EventClass", stream=lambda s: ("stream_ctx", s),
        memory_allocated=lambda i=None: 100, max_memory_allocated=lambda i=None: 150,
        memory_reserved=lambda i=None: 200, max_memory_reserved=lambda i=None: 250,
        empty_cache=lambda: calls.append(("empty",)),
        reset_peak_memory_stats=lambda i=None: calls.append(("reset", i)),
        get_device_properties=lambda i=None: types.SimpleNamespace(total_memory=1000),
        is_bf16_supported=lambda: False, get_device_capability=lambda: capability)
    return fake, calls


def test_cuda_answers_as_deepspeeds_cuda_accelerator(monkeypatch):
    fake, calls = _fake_cuda()
    a = Accelerator("cuda", torch_module=fake)
    assert (a.device_name(), a.device_name(1), a.current_device_name()) == ("cuda", "cuda:1", "cuda:3")
    assert a.communication_backend_name() == "nccl" and a.device_count() == 4 and a.current_device() == 3
    a.set_device(2)
    a.manual_seed(7)
    a.manual_seed_all(8)
    a.synchronize()
    a.empty_cache()
    a.reset_peak_memory_stats()
    assert calls == [("set_device", 2), ("seed", 7), ("seed_all", 8), ("sync", None), ("empty",), ("reset", None)]
    assert (a.Stream, a.Event, a.stream("s")) == ("StreamClass", "EventClass", ("stream_ctx", "s"))
    assert (a.memory_allocated(), a.max_memory_allocated(), a.memory_reserved(), a.max_memory_reserved()) == \
        (100, 150, 200, 250)
    assert a.total_memory() == 1000 and a.available_memory() == 900  # total - allocated without pynvml
    assert a.is_bf16_supported() is False and a.is_fp16_supported() is True
    assert a.supported_dtypes() == [torch.float32, torch.half]
    assert a.on_accelerator(types.SimpleNamespace(device="cuda:0")) and not a.on_accelerator(torch.zeros(1))


def test_cuda_fp16_follows_compute_capability(monkeypatch):
    monkeypatch.delenv("DS_ALLOW_DEPRECATED_FP16", raising=False)
    assert Accelerator("cuda", _fake_cuda((6, 1))[0]).is_fp16_supported() is False
    monkeypatch.setenv("DS_ALLOW_DEPRECATED_FP16", "1")
    assert Accelerator("cuda", _fake_cuda((6, 1))[0]).is_fp16_supported() is True
    assert Accelerator("cuda", _fake_cuda((5, 2))[0]).is_fp16_supported() is False
    unavailable = Accelerator("cuda", _fake_cuda(available=False)[0])
    assert unavailable.is_fp16_supported() and unavailable.is_bf16_supported()  # DeepSpeed's answer: True


def test_choice_follows_ds_accelerator(monkeypatch):
    monkeypatch.setattr(acc_mod, "_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator().device_name() == "cpu" and get_accelerator() is get_accelerator()
    monkeypatch.setattr(acc_mod, "_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="'xpu' is not supported by zerodp"):
        get_accelerator()
    monkeypatch.setattr(acc_mod, "_ACCELERATOR", None)
    monkeypatch.delenv("DS_ACCELERATOR")
    assert get_accelerator().device_name() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_missing_methods_name_themselves():
    a = Accelerator("cpu")
    with pytest.raises(NotImplementedError, match="create_op_builder"):
        a.create_op_builder("CPUAdamBuilder")
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        a.nonsense
