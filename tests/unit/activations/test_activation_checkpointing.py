"""ZeRO-R activation checkpointing in one process: exact against plain PyTorch (dropout on, from the
default generator and the RNG tracker), in both forms, with whole, host-offloaded and contiguous
checkpoints; what each keeps; the RNG tracker; the contiguous buffers; the config section and
DeepSpeed's `deepspeed.checkpointing` calls. Partitioning across ranks: tests/dist/test_activation_partition.py."""

from __future__ import annotations

import json

import pytest
import torch

import zerodp
from zerodp.activations import DEVICE, HOST, Checkpointer, RNGStatesTracker
from zerodp.activations.contiguous import ContiguousBuffers
from zerodp.activations.host_offload import host_placement
from zerodp.activations.model_parallel import ModelParallelGroup
from zerodp.activations.partition import keep_piece, piece_numel
from zerodp.config import ConfigError, load_config
from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig as Settings
import zerodp.deepspeed as deepspeed
from tests.activation_regions import assert_same, region_input_bytes, train

FORMS = ["checkpoint", "non_reentrant_checkpoint"]
SETTINGS = {
    "plain": Settings(),
    "cpu": Settings(cpu_checkpointing=True),
    "contiguous": Settings(contiguous_memory_optimization=True),
    "cpu+contiguous": Settings(cpu_checkpointing=True, contiguous_memory_optimization=True, number_checkpoints=3),
}


@pytest.fixture(autouse=True)
def _fresh_process_checkpointing():
    """deepspeed.checkpointing is process-wide: each test starts unconfigured, its tracker on the CPU generator
    (the one these tests draw from, also on a machine with CUDA)."""
    zerodp.activations.PROCESS.checkpointer, zerodp.activations.PROCESS.mpu = None, None
    zerodp.activations.PROCESS.tracker = RNGStatesTracker("cpu")
    yield
    zerodp.activations.PROCESS.checkpointer, zerodp.activations.PROCESS.mpu = None, None


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_exact_against_plain_pytorch(name, form):
    reference = train(None, None)
    checkpointer = Checkpointer(SETTINGS[name], tracker=RNGStatesTracker("cpu"))
    assert_same(reference, train(checkpointer, form))
    settings = SETTINGS[name]
    place, other = (HOST, DEVICE) if settings.cpu_checkpointing else (DEVICE, HOST)
    assert checkpointer.kept_bytes.peak[place] == region_input_bytes()  # one forward's region inputs
    assert checkpointer.kept_bytes.peak[other] == 0
    assert checkpointer.kept_bytes.live == {DEVICE: 0, HOST: 0}  # all released by backward
    if settings.contiguous_memory_optimization:  # 3 slots per input position, allocated once
        assert checkpointer.buffers.buffer_bytes == region_input_bytes()


def test_recomputation_without_restored_rng_differs():
    """The exactness above rests on the RNG snapshot: without it, the recomputed masks differ."""
    from zerodp.activations import checkpointer as module

    class NoRestore(module.RNGSnapshot):
        @classmethod
        def capture(cls, tracker):
            snap = super().capture(tracker)
            snap._apply = lambda: None
            return snap

    original = module.RNGSnapshot
    module.RNGSnapshot = NoRestore
    try:
        got = train(Checkpointer(Settings(), tracker=RNGStatesTracker("cpu")), "checkpoint")
    finally:
        module.RNGSnapshot = original
    assert not torch.equal(got["grads"][0], train(None, None)["grads"][0])


def test_no_grad_keeps_nothing_and_plain_keeps_references():
    checkpointer = Checkpointer(Settings())
    x = torch.randn(4, 4, requires_grad=True)
    with torch.no_grad():
        checkpointer.checkpoint(torch.sin, x)
    assert checkpointer.kept_bytes.peak[DEVICE] == 0
    y = checkpointer.non_reentrant_checkpoint(torch.sin, x)
    assert checkpointer.kept_bytes.live[DEVICE] == x.numel() * 4
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x))


def test_non_reentrant_supports_autograd_grad_and_frozen_inputs():
    checkpointer = Checkpointer(Settings(cpu_checkpointing=True))
    layer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)  # no input requires grad: only the parameters do
    (g,) = torch.autograd.grad(checkpointer.non_reentrant_checkpoint(layer, x).sum(), [layer.weight])
    torch.testing.assert_close(g, torch.autograd.grad(layer(x).sum(), [layer.weight])[0])
    with pytest.raises(RuntimeError, match="non_reentrant_checkpoint"):
        torch.autograd.grad(checkpointer.checkpoint(layer, x.requires_grad_()).sum(), [x])


def test_rng_tracker_on_cpu():
    tracker = RNGStatesTracker("cpu")
    torch.manual_seed(0)
    before = torch.get_rng_state()
    tracker.add("tp", 123)
    assert torch.equal(torch.get_rng_state(), before)  # adding does not disturb the default generator
    with tracker.fork("tp"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, torch.rand(3, generator=torch.Generator().manual_seed(123)))
    with tracker.fork("tp"):
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the fork keeps its advance
    with pytest.raises(ValueError, match="seed 123"):
        tracker.add("other", 123)
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with tracker.fork("missing"):
            pass


class _MPU:
    """A Megatron-style mpu of one rank (the multi-rank one is in tests/dist)."""

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0


def test_model_parallel_cuda_manual_seed_is_megatrons():
    deepspeed.checkpointing.configure(_MPU())
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(7)
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(7)))
    with tracker.fork():
        got = torch.rand(2)
    assert torch.equal(got, torch.rand(2, generator=torch.Generator().manual_seed(7 + 2718 + 0)))


def test_megatron_and_lightning_calls(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": {
        "partition_activations": True, "contiguous_memory_optimization": True, "cpu_checkpointing": True}}))
    # Megatron-DeepSpeed: configure(mpu, deepspeed_config=..., num_checkpoints=...), then checkpoint(...)
    deepspeed.checkpointing.configure(_MPU(), deepspeed_config=str(path), num_checkpoints=3)
    assert deepspeed.checkpointing.is_configured()
    settings = zerodp.activations.PROCESS.checkpointer.settings
    assert (settings.partition_activations, settings.cpu_checkpointing, settings.number_checkpoints) == (True, True, 3)
    checkpointer = zerodp.activations.PROCESS.checkpointer
    assert_same(train(None, None), train(checkpointer, "checkpoint"))
    assert checkpointer.kept_bytes.peak[HOST] == region_input_bytes()  # a piece of one rank: the whole
    # Lightning: configure(mpu_=None, ...) with None for unset keys keeps the mpu given before.
    deepspeed.checkpointing.configure(mpu_=None, partition_activations=None, contiguous_checkpointing=False,
                                      checkpoint_in_cpu=True, profile=True)
    settings = zerodp.activations.PROCESS.checkpointer.settings
    assert (settings.partition_activations, settings.cpu_checkpointing, settings.profile) == (False, True, True)
    deepspeed.checkpointing.reset()


def test_dialect_checkpoint_uses_the_configured_checkpointer():
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True, profile=True)
    checkpointer = zerodp.activations.PROCESS.checkpointer
    reference = train(None, None, tracker=checkpointer.tracker)

    class Dialect:  # train() calls getattr(checkpointer, form): route it to the module-level functions
        tracker = checkpointer.tracker
        checkpoint = staticmethod(deepspeed.checkpointing.checkpoint)
        non_reentrant_checkpoint = staticmethod(deepspeed.checkpointing.non_reentrant_checkpoint)

    for form in FORMS:
        assert_same(reference, train(Dialect, form))
    assert checkpointer.kept_bytes.peak[HOST] == region_input_bytes() and checkpointer.kept_bytes.peak[DEVICE] == 0
    assert {phase for phase, _ in checkpointer.timings} == {"forward", "backward"}  # profile


def test_partition_without_mpu_is_an_error():
    with pytest.raises(ValueError, match="no model-parallel unit"):
        deepspeed.checkpointing.configure(None, partition_activations=True)
    with pytest.raises(ValueError, match="no model-parallel unit"):
        zerodp.initialize(torch.nn.Linear(2, 2), torch.optim.SGD, {
            "train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"partition_activations": True}})
    with pytest.raises(TypeError, match="not a model-parallel unit"):
        deepspeed.checkpointing.configure(3)


def test_config_section():
    config = load_config({"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4,
                                                       "contiguous_memory_optimization": True}})
    assert config.activation_checkpointing.cpu_checkpointing and config.activation_checkpointing.number_checkpoints == 4
    with pytest.raises(ConfigError, match="did you mean 'partition_activations'"):
        load_config({"activation_checkpointing": {"partition_activation": True}})
    with pytest.raises(ConfigError, match="number_checkpoints"):
        load_config({"activation_checkpointing": {"number_checkpoints": 0, "contiguous_memory_optimization": True}})
    with pytest.raises(ConfigError, match="would have no effect"):
        load_config({"activation_checkpointing": {"number_checkpoints": 4}})
    # Megatron passes num_checkpoints on every run: accepted through configure, unused without buffers
    deepspeed.checkpointing.configure(None, num_checkpoints=4)
    assert zerodp.activations.PROCESS.checkpointer.settings.number_checkpoints is None
    for field in Settings.model_fields.values():
        assert field.description, "every key is documented"


def test_initialize_installs_the_section():
    model = torch.nn.Linear(2, 2)
    zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"cpu_checkpointing": True}})
    assert zerodp.activations.PROCESS.checkpointer.settings.cpu_checkpointing
    assert deepspeed.checkpointing.is_configured()


def test_contiguous_buffers_learn_and_refuse():
    learned = ContiguousBuffers(None)
    slots = [learned.acquire(0, 10, torch.float32, torch.device("cpu"), False) for _ in range(3)]
    assert all(s.view is None for s in slots) and learned.buffer_bytes == 0  # first forward: counting
    for s in slots:
        learned.release(s)
    slots = [learned.acquire(0, 10, torch.float32, torch.device("cpu"), False) for _ in range(3)]
    assert learned.buffer_bytes == 3 * 10 * 4  # allocated once for the count it saw
    assert [s.view.data_ptr() for s in slots] == [slots[0].view.data_ptr() + 40 * i for i in range(3)]  # in order
    with pytest.raises(ValueError, match="not homogeneous"):
        learned.acquire(0, 11, torch.float32, torch.device("cpu"), False)
    fixed = ContiguousBuffers(2)
    fixed.acquire(0, 4, torch.float32, torch.device("cpu"), False)
    fixed.acquire(0, 4, torch.float32, torch.device("cpu"), False)
    with pytest.raises(RuntimeError, match="number_checkpoints=2"):
        fixed.acquire(0, 4, torch.float32, torch.device("cpu"), False)


def test_placement_and_piece_arithmetic():
    assert host_placement(torch.device("cuda", 0)) == host_placement(torch.device("cuda", 1))
    assert host_placement(torch.device("cuda", 0)).pinned and host_placement(torch.device("cuda", 0)).side_stream
    assert not host_placement(torch.device("cpu")).pinned and not host_placement(torch.device("cpu")).side_stream
    assert [piece_numel(n, 2) for n in (1, 2, 7)] == [1, 1, 4]
    x = torch.arange(7.0)
    pieces = [keep_piece(x, ModelParallelGroup(None, r, 2)) for r in range(2)]
    assert pieces[0].tolist() == [0, 1, 2, 3] and pieces[1].tolist() == [4, 5, 6, 0]  # last piece zero-padded
    assert pieces[0].data_ptr() != x.data_ptr()  # a copy: the whole input can be freed


def test_contiguous_buffers_grow_and_come_back_from_dropped_graphs():
    buffers = ContiguousBuffers(None)
    cpu = torch.device("cpu")
    for count in (2, 2):  # the first forward sizes the buffer; the second uses it
        slots = [buffers.acquire(0, 5, torch.float32, cpu, False) for _ in range(count)]
        for s in slots:
            buffers.release(s)
    assert buffers.buffer_bytes == 2 * 5 * 4
    slots = [buffers.acquire(0, 5, torch.float32, cpu, False) for _ in range(3)]  # one more region than slots
    assert slots[2].view is None  # kept in an ordinary tensor this time
    for s in slots:
        buffers.release(s)
    assert buffers.buffer_bytes == 0  # dropped, to grow at the next forward
    slots = [buffers.acquire(0, 5, torch.float32, cpu, False) for _ in range(3)]
    assert buffers.buffer_bytes == 3 * 5 * 4 and all(s.view is not None for s in slots)
    # A region whose graph is dropped without a backward gives its slot and bytes back.
    checkpointer = Checkpointer(Settings(contiguous_memory_optimization=True, number_checkpoints=1))
    x = torch.randn(3, 3, requires_grad=True)
    for _ in range(3):  # with one slot, a leaked slot would fail the second forward
        out = checkpointer.checkpoint(torch.tanh, x)
        assert checkpointer.kept_bytes.live[DEVICE] == 36
        del out
    assert checkpointer.kept_bytes.live[DEVICE] == 0


def test_deepspeed_helpers_and_module_path():
    from zerodp.adapters.deepspeed.runtime.activation_checkpointing import checkpointing as runtime_path

    assert runtime_path.configure is deepspeed.checkpointing.configure
    deepspeed.checkpointing.configure(_MPU(), contiguous_checkpointing=True)
    deepspeed.checkpointing.set_num_layers(5)
    deepspeed.checkpointing.partition_activations_in_checkpoint(True)
    settings = zerodp.activations.PROCESS.checkpointer.settings
    assert (settings.number_checkpoints, settings.partition_activations, settings.contiguous_memory_optimization) \
        == (5, True, True)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(1)
    deepspeed.checkpointing.model_parallel_reconfigure_tp_seed(4)
    with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
        got = torch.rand(2)
    assert torch.equal(got, torch.rand(2, generator=torch.Generator().manual_seed(4 + 2718)))


@pytest.mark.parametrize("form", FORMS)
def test_recomputation_keeps_the_forwards_autocast(form):
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)  # the re-entrant form needs an input that requires grad

    def grads(checkpointer):
        layers.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # backward runs outside it, as in a training loop
            out = layers(x) if checkpointer is None else getattr(checkpointer, form)(layers, x)
        out.float().pow(2).sum().backward()
        return [p.grad.clone() for p in layers.parameters()]

    for a, b in zip(grads(None), grads(Checkpointer(Settings()))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bf16 recomputed in bf16: the same values


def test_an_explicit_configure_survives_the_engine_section():
    """Megatron-DeepSpeed configures (with num_checkpoints) before deepspeed.initialize reads the same file."""
    config = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {
        "cpu_checkpointing": True, "contiguous_memory_optimization": True}}
    deepspeed.checkpointing.configure(None, deepspeed_config=config, num_checkpoints=4)
    model = torch.nn.Linear(2, 2)
    zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    assert zerodp.activations.PROCESS.checkpointer.settings.number_checkpoints == 4
    zerodp.activations.PROCESS.checkpointer = None  # an engine's section replaces another engine's
    for cpu in (True, False):
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          {**config, "activation_checkpointing": {"cpu_checkpointing": cpu}})
        assert zerodp.activations.PROCESS.checkpointer.settings.cpu_checkpointing is cpu
