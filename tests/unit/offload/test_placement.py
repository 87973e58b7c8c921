"""Where each state lives (`zerodp.offload.placement`), answered for a model on `cuda:0` on a machine without a GPU
(a device is a value), for every offload mode, stage and precision; and the step plan's device decisions
(issue 31: ZeRO-Offload crashed at its first CUDA step because states were on the CPU and masters on the GPU)."""

from __future__ import annotations

import pytest
import torch

from zerodp.config import load_config
from zerodp.offload.placement import HOST, Home, placement_of

CUDA = torch.device("cuda", 0)
BF16, FP32 = torch.bfloat16, torch.float32


def config(stage: int, bf16: bool, optimizer: str = "none", param: str = "none", pin: bool = False, tmp="/tmp"):
    zero = {"stage": stage}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, "nvme_path": str(tmp), "pin_memory": pin}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": str(tmp), "pin_memory": pin}
    return load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": bf16}, "zero_optimization": zero})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bf16", [False, True])
def test_without_offload_everything_lives_on_the_model_device(stage, bf16):
    p = placement_of(config(stage, bf16), CUDA)
    dtype = BF16 if bf16 else FP32
    assert p.compute == Home(CUDA, dtype) and p.grads == Home(CUDA, dtype)
    assert p.param_shards == p.compute and p.grad_shards == p.grads
    assert p.masters == Home(CUDA, FP32) and p.states == Home(CUDA, FP32)
    assert p.grad_staging is None and p.param_staging is None
    assert not p.steps_on_host and p.masters_are_shards == (not bf16)
    assert not p.param_shards_offloaded and not p.grad_shards_offloaded


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("pin", [False, True])
def test_zero_offload_on_a_gpu_steps_on_the_host_through_pinned_staging(stage, bf16, device, pin, tmp_path):
    p = placement_of(config(stage, bf16, optimizer=device, pin=pin, tmp=tmp_path), CUDA)
    dtype = BF16 if bf16 else FP32
    assert p.compute == Home(CUDA, dtype) and p.grads == Home(CUDA, dtype)  # compute and backward stay
    assert p.param_shards == p.compute
    assert p.masters == Home(HOST, FP32)  # fp32 too: a master on the host is never the GPU shard
    assert p.states == Home(HOST, FP32, pinned=pin, files=device == "nvme")
    assert p.grad_staging == Home(HOST, dtype, pinned=True)  # the copies carry the shard's dtype (fp32 on the host)
    assert p.param_staging == Home(HOST, dtype, pinned=True)
    assert p.steps_on_host and not p.masters_are_shards


@pytest.mark.parametrize("precision,accum,staged", [("fp16", None, torch.float16), ("bf16", "fp32", FP32),
                                                    ("fp32", "bf16", BF16)])
def test_the_gradient_copies_to_the_host_carry_the_shards_dtype(precision, accum, staged):
    """The shard's dtype is the accumulation dtype (the parameters' unless data_types.grad_accum_dtype says):
    the copy to the host carries it, the step reads it widened to fp32 (optim/grad_staging.py)."""
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    p = placement_of(load_config(cfg), CUDA)
    assert p.grads.dtype == staged and p.grad_staging == Home(HOST, staged, pinned=True)
    assert p.masters.dtype == FP32


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("optimizer", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_offload_param_on_a_gpu_moves_the_shards_and_leaves_the_masters_to_offload_optimizer(bf16, optimizer, param,
                                                                                             tmp_path):
    p = placement_of(config(3, bf16, optimizer=optimizer, param=param, pin=True, tmp=tmp_path), CUDA)
    dtype = BF16 if bf16 else FP32
    assert p.compute == Home(CUDA, dtype)
    if param == "cpu":
        assert p.param_shards == Home(HOST, dtype, pinned=True)
    else:  # read into GPU memory while used, files at rest
        assert p.param_shards == Home(CUDA, dtype, pinned=True, files=True)
    assert p.param_shards_offloaded
    # fp32 gradient shards go to the parameters' files with nvme; in bf16 the step converts them whole
    assert p.grad_shards_offloaded == (param == "nvme" and not bf16)
    assert p.masters.device == (CUDA if optimizer == "none" else HOST)
    assert p.steps_on_host == (optimizer != "none")
    assert p.masters_are_shards == (optimizer == "none" and not bf16)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("optimizer", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_on_a_cpu_model_host_memory_is_the_only_memory(bf16, optimizer, param, tmp_path):
    """cpu offload moves nothing, nothing is pinned, no staging, and fp32 masters are the shards
    (the CPU results stay bitwise those of the code before placement)."""
    p = placement_of(config(3, bf16, optimizer=optimizer, param=param, pin=True, tmp=tmp_path), HOST)
    assert {h.device for h in (p.compute, p.grads, p.param_shards, p.grad_shards, p.masters, p.states)} == {HOST}
    assert not any(h.pinned for h in (p.compute, p.grads, p.param_shards, p.grad_shards, p.masters, p.states))
    assert p.grad_staging is None and p.param_staging is None and not p.steps_on_host
    assert p.masters_are_shards == (not bf16)
    assert p.param_shards_offloaded == (param == "nvme")
    assert p.states.files == (optimizer == "nvme")


def test_the_engine_and_its_optimizer_take_the_placement(tmp_path):
    """On CPU: the engine's placement is the one its optimizer stepped with; masters follow it."""
    import zerodp
    from tests.dist.common import make_model, make_optimizer

    model = make_model()
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with zerodp.initialize(model, make_optimizer("adamw", model), cfg) as engine:
        assert engine.placement == placement_of(engine.config, HOST)
        assert engine.optimizer.placement is engine.placement
        assert all(m.device == HOST and m.dtype == FP32 for m in engine.optimizer.masters)


def _train(cfg: dict, placement_override=None, steps: int = 3):
    """A few clipped AdamW steps of ParityNet in one process; the final parameters (fp32, CPU)."""
    import dataclasses

    import torch.nn.functional as F

    import zerodp
    import zerodp.engine.zero_engine as engine_module
    from tests.dist.common import global_batch, make_model, make_optimizer

    original = engine_module.placement_of
    if placement_override is not None:  # the engine takes its placement from placement_of: hand it the forced one
        engine_module.placement_of = lambda config, device: dataclasses.replace(original(config, device),
                                                                                 **placement_override(config))
    try:
        model = make_model()
        with zerodp.initialize(model, make_optimizer("adamw", model), cfg) as engine:
            for step in range(steps):
                x, y = global_batch(step, 4)
                engine.backward(F.mse_loss(engine(x).float(), y))
                engine.step()
            return engine.full_state_dict()
    finally:
        engine_module.placement_of = original


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("stage,offload", [(1, {}), (2, {"offload_optimizer": {"device": "cpu"}}),
                                           (3, {"offload_optimizer": {"device": "nvme"}}),
                                           (3, {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "cpu"}})])
def test_a_step_through_host_staging_is_bitwise_the_step_in_place(bf16, stage, offload, tmp_path):
    """The ZeRO-Offload path of a GPU (masters apart from the shards, gradients copied into staging buffers,
    parameters written back through one) run on the CPU by forcing the placement: on one device the copies
    change no value, so it must equal the plain step bit for bit. Covers the plan's host-step code (the
    crash of issue 31 item 2 was in this step) wherever the CPU can reach it."""
    for section in offload.values():
        section["nvme_path"] = str(tmp_path)
    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": bf16}, "gradient_clipping": 0.05,
           "zero_optimization": {"stage": stage, **offload}}
    dtype = BF16 if bf16 else FP32
    forced = lambda config: {"masters_are_shards": False, "grad_staging": Home(HOST, dtype),  # noqa: E731
                             "param_staging": Home(HOST, dtype)}  # the GPU's homes, unpinned
    plain = _train(cfg)
    staged = _train(cfg, forced)
    assert plain.keys() == staged.keys()
    for key in plain:
        assert torch.equal(plain[key], staged[key]), key
    fresh = _train(cfg, steps=0)
    assert not torch.equal(fresh["hidden.weight"], plain["hidden.weight"])  # it trained


@pytest.mark.parametrize("pin", [False, True])
def test_offload_param_cpu_keeps_a_store_exactly_where_the_shards_leave_the_model_device(pin):
    """offload_param cpu: a host-backed store (pinned as configured) for a cuda:0 model, none for a CPU one."""
    from zerodp.offload.shard_store import ShardStore
    from zerodp.offload.tier import build_param_offload

    cfg = config(3, True, param="cpu", pin=pin)
    store = build_param_offload(cfg, 1000, 2, 100, None, CUDA)
    assert isinstance(store, ShardStore) and store.rank_dir is None and store.pin_memory == pin
    assert build_param_offload(cfg, 1000, 2, 100, None, HOST) is None


def test_a_host_step_refuses_an_optimizer_built_for_cuda_graphs():
    from zerodp.optim.step_plan import check_host_step

    offloaded = placement_of(config(2, True, optimizer="cpu"), CUDA)
    with pytest.raises(ValueError, match="capturable=True"):
        check_host_step([{"lr": 1e-3}, {"lr": 1e-3, "capturable": True}], offloaded)
    check_host_step([{"lr": 1e-3, "capturable": True}], placement_of(config(2, True), CUDA))  # steps on the GPU
    check_host_step([{"lr": 1e-3, "capturable": False}], offloaded)
