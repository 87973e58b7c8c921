"""What DeepSpeed-Chat's training scripts (tests/e2e/deepspeed_scripts/deepspeed_chat) call beyond the other
collected scripts: `deepspeed.compression.helper`'s module-path helpers (its LoRA), the launcher's
`--local_rank` argument, an engine made without an optimizer (DPO's reference model), the engine answering
with its module's attributes (`engine.model`), `engine.tput_timer`, and a client schedule over the script's
own optimizer stepping without torch's "scheduler before optimizer" warning. No process group here."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

import zerodp.deepspeed as deepspeed
from zerodp.config import ConfigError
from zerodp.deepspeed.compression.helper import recursive_getattr, recursive_setattr
from zerodp.deepspeed.engine import ClientSchedule, DeepSpeedEngine
from zerodp.deepspeed.forward_engine import ForwardEngine
from zerodp.deepspeed.utils.timer import ThroughputTimer

BF16_STAGE0 = {"train_batch_size": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}


def test_recursive_getattr_and_setattr_follow_named_modules_paths():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    assert recursive_getattr(model, "1.1") is model[1][1]
    assert recursive_getattr(model, "1.1.weight") is model[1][1].weight
    replacement = torch.nn.Linear(3, 1)
    recursive_setattr(model, "1.1", replacement)
    assert model[1][1] is replacement and dict(model.named_modules())["1.1"] is replacement
    recursive_setattr(model, "0", torch.nn.Identity())  # a top-level name has no parent path
    assert isinstance(model[0], torch.nn.Identity)
    with pytest.raises(AttributeError):
        recursive_getattr(model, "1.7")


def test_run_passes_local_rank_first_as_deepspeeds_launcher(tmp_path, monkeypatch):
    script, out = tmp_path / "train.py", tmp_path / "argv.txt"
    script.write_text(f"import sys\nopen({str(out)!r}, 'w').write(' '.join(sys.argv[1:]))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    saved_path = list(sys.meta_path)
    from zerodp.deepspeed.run import main

    try:
        monkeypatch.setenv("LOCAL_RANK", "1")
        main(["--local_rank", str(script), "--zero_stage", "2"])
        assert out.read_text() == "--local_rank=1 --zero_stage 2"
        main([str(script), "--zero_stage", "2"])  # without the flag: the arguments as given
        assert out.read_text() == "--zero_stage 2"
        monkeypatch.delenv("LOCAL_RANK")
        with pytest.raises(SystemExit, match="LOCAL_RANK is not set; launch with torchrun"):
            main(["--local_rank", str(script)])
    finally:
        for k in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.meta_path[:] = saved_path


def test_initialize_without_an_optimizer_gives_a_forward_engine_in_the_compute_dtype():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    want = torch.nn.functional.linear(torch.ones(3, 4).bfloat16(), model.weight.bfloat16(), model.bias.bfloat16())
    engine, optimizer, loader, schedule = deepspeed.initialize(model=model, config=BF16_STAGE0,
                                                               dist_init_required=False)
    assert isinstance(engine, ForwardEngine) and (optimizer, loader, schedule) == (None, None, None)
    assert model.weight.dtype == torch.bfloat16  # DeepSpeed casts the module, not the inputs
    assert torch.equal(engine(torch.ones(3, 4).bfloat16()), want)
    assert engine.eval() is engine and not model.training and engine.in_features == 4  # the module's attribute
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.backward(torch.zeros(()))
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.step()


def test_forward_engine_refuses_a_schedule_without_optimizer():
    # (at stage 3 the forward-only engine shards the model: tests/dist/test_deepspeed_forward_engine.py)
    with pytest.raises(ConfigError, match="schedule or training_data but no optimizer"):
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config=BF16_STAGE0, dist_init_required=False,
                             lr_scheduler=lambda opt: None)


def _adapter(model: torch.nn.Module, inner: torch.optim.Optimizer) -> DeepSpeedEngine:
    zero = SimpleNamespace(module=model, optimizer=SimpleNamespace(optimizer=inner, param_groups=inner.param_groups,
                                                                   group_indices=[0]),
                           lr_scheduler=None, train_batch_size=4)
    return DeepSpeedEngine(zero)


def test_engine_answers_with_its_modules_attributes_after_its_own():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.model = model[0]  # as an HF causal LM's `.model` (DeepSpeed-Chat reads engine.model)
    engine = _adapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.model is model[0] and engine.optimizer.optimizer is not None  # the engine's own first
    with pytest.raises(AttributeError, match="neither has its module, Sequential"):
        engine.no_such_attribute


def test_throughput_timer_skips_warmup_and_counts_epochs():
    timer = ThroughputTimer(batch_size=8, start_step=2)
    assert timer.avg_samples_per_sec() == float("-inf")
    for _ in range(4):
        timer.start()
        timer.stop(global_step=True)
    timer.stop(global_step=True)  # a stop without a start counts nothing
    assert (timer.global_step_count, timer.micro_step_count) == (4, 4)
    assert timer.avg_samples_per_sec() > 0  # 2 timed steps of 8 samples
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)


def test_client_schedule_over_the_scripts_optimizer_steps_without_torchs_order_warning():
    model = torch.nn.Linear(2, 2)
    user = torch.optim.AdamW(model.parameters(), lr=1.0)  # the script's: never stepped (the engine's copy is)
    inner = torch.optim.AdamW(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(user, lambda step: 0.5 ** step)
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=inner, param_groups=inner.param_groups,
                                                       group_indices=[0]))
    client = ClientSchedule(schedule, engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" would raise
        client.step()
    assert inner.param_groups[0]["lr"] == 0.5  # the schedule's lr reached the engine's optimizer
