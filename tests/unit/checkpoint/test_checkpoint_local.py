"""Checkpoints of a one-process engine (no process group): round trip, a changed bucket layout,
atomic commit, and every bad input raising its documented CheckpointError without changing the
engine or the files."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp
from tests.dist.common import make_model, make_optimizer, micro_batch
from zerodp import CheckpointError
from zerodp.checkpoint import format as fmt
from zerodp.checkpoint import consolidate_main

CONFIG = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1, "reduce_bucket_size": 300}}


def engine_for(model, opt_name="adamw", config=CONFIG):
    return zerodp.initialize(model, make_optimizer(opt_name, model), config)


def train(engine, steps, first=0):
    for step in range(first, first + steps):
        x, y = micro_batch(step, 0, 0, 1, 4, 1)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A checkpoint directory with tags global_step2 and global_step3 (latest)."""
    model = make_model()
    engine = engine_for(model)
    train(engine, 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    train(engine, 1, first=2)
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"note": "three"})
    return tmp_path / "ckpt"


def assert_load_fails(ckpt_dir, match, tag=None, model=None, opt_name="adamw"):
    """Loading raises CheckpointError(match) and changes neither the engine nor the files; returns the message."""
    model = model or make_model(seed=3)
    engine = engine_for(model, opt_name)
    before, files = snapshot(model), tree_digest(Path(ckpt_dir))
    with pytest.raises(CheckpointError, match=match) as info:
        engine.load_checkpoint(ckpt_dir, tag=tag)
    after = snapshot(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert engine.global_step == 0 and not engine.optimizer.optimizer.state
    assert tree_digest(Path(ckpt_dir)) == files
    return str(info.value)


def test_round_trip_in_one_process(ckpt):
    model = make_model(seed=3)
    engine = engine_for(model)
    assert engine.load_checkpoint(ckpt) == {"note": "three"}
    assert engine.global_step == 3
    assert engine.load_checkpoint(ckpt, tag="global_step2") == {}  # no client_state given then
    assert engine.global_step == 2
    consolidated = zerodp.consolidate_checkpoint(ckpt, tag="global_step2")
    assert all(torch.equal(consolidated[k], v) for k, v in model.state_dict().items())


def test_hyper_parameters_loss_scale_and_counters_are_restored(tmp_path):
    config = dict(CONFIG, fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2})
    model = make_model()
    engine = engine_for(model, "lamb", config)
    train(engine, 3)
    engine.optimizer.param_groups[1]["lr"] = 0.123  # e.g. a schedule's value
    engine.save_checkpoint(tmp_path)
    other = engine_for(make_model(seed=3), "lamb", config)
    other.load_checkpoint(tmp_path)
    assert other.scaler.state_dict() == engine.scaler.state_dict() and engine.scaler.scale == 2.0 ** 9
    assert [g["lr"] for g in other.optimizer.param_groups] == [1e-2, 0.123]
    assert other.optimizer.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again
    assert (other.global_step, other.micro_step, other.skipped_steps) == (3, 3, 0)
    state = other.optimizer.state_of(0)
    assert state["step"] == 3 and type(state["step"]) is int  # LAMB counts in a Python int
    for name, value in model.state_dict().items():  # fp16 model weights: the fp32 masters, rounded
        assert torch.equal(other.module.state_dict()[name], value), name


def state_by_name(model, engine, key="exp_avg_sq") -> dict:
    """Each parameter's slice of one optimizer state tensor (world 1: a master is its unit's whole buffer)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for index, unit in enumerate(engine.units):
        state = engine.optimizer.state_of(index)
        assert float(state["step"]) == engine.global_step
        for p, offset, numel in zip(unit.params, unit.layout.offsets, unit.layout.numels):
            out[names[id(p)]] = state[key][offset:offset + numel]
    return out


def test_another_bucket_layout_reads_the_overlapping_slices(ckpt):
    """Saved with 300-element buckets, loaded into one bucket per group (the world-1 analogue of a
    new world size): the masters and Adam's moments land where they belong."""
    reference = make_model(seed=3)
    ref_engine = engine_for(reference)
    ref_engine.load_checkpoint(ckpt)
    merged = make_model(seed=4)
    engine = engine_for(merged, config=dict(CONFIG, zero_optimization={"stage": 1, "reduce_bucket_size": 10**6}))
    assert len(engine.units) < len(ref_engine.units)
    engine.load_checkpoint(ckpt)
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in merged.state_dict().items())
    ref_moments, moments = state_by_name(reference, ref_engine), state_by_name(merged, engine)
    assert ref_moments.keys() == moments.keys()
    assert all(torch.equal(moments[k], v) for k, v in ref_moments.items())
    train(ref_engine, 2, first=3)
    train(engine, 2, first=3)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=1e-6, atol=1e-7)


def test_optimizer_state_that_disagrees_cannot_be_merged(ckpt):
    meta_path = ckpt / "global_step3" / fmt.META_FILE
    meta = json.loads(meta_path.read_text())
    units = meta["units"][0]
    assert len(units) > 2 and units[0]["scalars"]["step"]["value"] == 3.0
    units[0]["scalars"]["step"]["value"] = 2.0  # as if that unit had skipped a step
    meta_path.write_text(json.dumps(meta))
    engine_for(make_model(seed=3)).load_checkpoint(ckpt)  # the same layout: each unit keeps its own step
    merged = engine_for(make_model(seed=3), config=dict(CONFIG, zero_optimization={"stage": 1,
                                                                                    "reduce_bucket_size": 10**6}))
    with pytest.raises(CheckpointError, match="saved in different optimizer states end up in one shard"):
        merged.load_checkpoint(ckpt)


def test_overwriting_a_tag_and_stale_temporary_directories(ckpt):
    # a save that crashed for good left a temporary directory behind: loading ignores it...
    stale = ckpt / ".tmp-global_step9"
    stale.mkdir()
    (stale / fmt.shard_file(0, 1)).write_bytes(b"half a file")
    assert zerodp.consolidate_checkpoint(ckpt).keys()
    # ...and the next save removes it; saving an existing tag replaces it whole
    model = make_model(seed=5)
    engine = engine_for(model)
    engine.save_checkpoint(ckpt, tag="global_step2")
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step2", "global_step3", "latest"]
    assert (ckpt / "latest").read_text().strip() == "global_step2"
    consolidated = zerodp.consolidate_checkpoint(ckpt)
    assert all(torch.equal(consolidated[k], v) for k, v in model.state_dict().items())


def test_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_load_fails(tmp_path / "empty", "is not a zerodp checkpoint directory")
    assert_load_fails(tmp_path / "nowhere", "does not exist")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        zerodp.consolidate_checkpoint(tmp_path / "file")


def test_missing_tag_lists_the_available_ones(ckpt):
    assert_load_fails(ckpt, r"tag 'step7' not found in .* \(available tags: global_step2, global_step3\)", tag="step7")
    (ckpt / "latest").write_text("gone\n")
    assert_load_fails(ckpt, r"tag 'gone' not found")


class Wider(nn.Module):
    """ParityNet's names with one shape changed, one name renamed and one added."""

    def __init__(self):
        super().__init__()
        for name, child in make_model().named_children():
            setattr(self, name, child)
        self.gain2 = nn.Parameter(torch.ones(23))  # ParityNet's `gain`, renamed
        self.hidden = nn.Linear(23, 24)
        self.out = nn.Linear(24, 5)
        self.extra = nn.Parameter(torch.zeros(2))


def test_checkpoint_of_another_model_lists_the_differences(ckpt):
    message = assert_load_fails(ckpt, "does not match this model", model=Wider())
    assert "in the model but not in the checkpoint: gain2, extra" in message
    assert "in the checkpoint but not in the model: gain" in message
    assert "hidden.weight (23, 23) vs (24, 23)" in message and "out.weight (5, 23) vs (5, 24)" in message


def test_frozen_versus_trainable_is_a_difference(ckpt):
    model = make_model(seed=3)
    model.frozen.requires_grad_(True)
    assert_load_fails(ckpt, r"role differs \(checkpoint vs model\): frozen.weight frozen vs param", model=model)


def test_other_optimizer_class(ckpt):
    assert_load_fails(ckpt, r"holds the state of torch.optim.adamw.AdamW, but the engine's optimizer is "
                            r"torch.optim.sgd.SGD", opt_name="sgd")
    assert_load_fails(ckpt, "AdamW, but the engine's optimizer is torch.optim.sgd.SGD in LARC", opt_name="larc")


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("name", [fmt.shard_file(0, 1), fmt.MODEL_STATES_FILE, fmt.rng_file(0),
                                  fmt.CLIENT_STATE_FILE])
def test_damaged_file_is_detected(ckpt, name, damage):
    path = ckpt / "global_step3" / name
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        path.unlink()
    expected = re.escape(f"global_step3 is incomplete: {name} is missing" if damage == "delete" else
                         f"{name} is corrupted or truncated")
    assert_load_fails(ckpt, expected)
    if name in (fmt.shard_file(0, 1), fmt.MODEL_STATES_FILE):  # the files consolidation reads
        with pytest.raises(CheckpointError, match=expected):
            zerodp.consolidate_checkpoint(ckpt)
    zerodp.consolidate_checkpoint(ckpt, tag="global_step2")  # the other checkpoint is still whole


def test_truncated_metadata(ckpt):
    meta = ckpt / "global_step3" / fmt.META_FILE
    meta.write_text(meta.read_text()[:100])
    assert_load_fails(ckpt, "meta.json is unreadable or truncated")


def test_save_in_the_middle_of_accumulation_is_refused(tmp_path):
    model = make_model()
    engine = engine_for(model, config=dict(CONFIG, gradient_accumulation_steps=2))
    x, y = micro_batch(0, 0, 0, 1, 4, 1)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    with pytest.raises(CheckpointError, match="in the middle of gradient accumulation"):
        engine.save_checkpoint(tmp_path)
    assert not any(tmp_path.iterdir())
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        engine.save_checkpoint(tmp_path, tag="../x")


def test_cli(ckpt, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert consolidate_main([str(ckpt), str(out), "--tag", "global_step2"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert consolidate_main([str(ckpt), str(tmp_path / "model.npz")]) == 1
    assert consolidate_main([str(ckpt), str(tmp_path / "m.pt"), "--tag", "nope"]) == 1
    assert consolidate_main([str(tmp_path / "nothing"), str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("zerodp consolidate: error: ") for line in err)
    assert "cannot tell the format" in err[0] and "tag 'nope' not found" in err[1] and "does not exist" in err[2]
    assert not (tmp_path / "m.pt").exists()


def test_buffers_and_frozen_parameters_are_restored(tmp_path):
    def net():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
        model[0].requires_grad_(False)
        return model

    model = net()
    engine = zerodp.initialize(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                               {"train_micro_batch_size_per_gpu": 8})
    for step in range(2):
        engine.backward(engine(torch.randn(8, 4)).square().mean())
        engine.step()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # frozen parameters can still be edited by the user; they are saved as they are
    engine.save_checkpoint(tmp_path)
    fresh = net()
    other = zerodp.initialize(fresh, torch.optim.SGD([p for p in fresh.parameters() if p.requires_grad], lr=0.1),
                              {"train_micro_batch_size_per_gpu": 8})
    other.load_checkpoint(tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert fresh.state_dict()["1.num_batches_tracked"].item() == 2
    consolidated = zerodp.consolidate_checkpoint(tmp_path)
    assert consolidated["1.num_batches_tracked"].dtype == torch.int64
    plain = net()
    plain.load_state_dict(consolidated, strict=True)


def test_writing_the_consolidated_file(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="cannot tell the format"):
        zerodp.save_consolidated(ckpt, tmp_path / "model.txt")
    path = zerodp.save_consolidated(ckpt, tmp_path / "sub" / "model.pt")
    loaded = torch.load(path, weights_only=True)
    consolidated = zerodp.consolidate_checkpoint(ckpt)
    assert all(torch.equal(loaded[k], v) for k, v in consolidated.items())


@pytest.mark.parametrize("stage", [1, 3])
def test_a_save_whose_tensors_are_copied_to_the_host_resumes_exactly(tmp_path, monkeypatch, stage):
    """Issue 31 item 1 on the CPU: on a GPU every tensor the writer saves is first copied to the host
    (`.cpu()` returns a new tensor), and those copies were freed before their bytes were written, so the
    small ones (biases, gain, out/unused weights) resumed as garbage. Here `.cpu()` copies as it does on a
    GPU; the bf16 run of the GPU test resumes bit for bit."""
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    engine = engine_for(make_model(), config=config)
    train(engine, 2)
    saved = engine.full_state_dict()
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: self.clone())  # a new tensor, as from a GPU
        engine.save_checkpoint(tmp_path)
    resumed = engine_for(make_model(seed=3), config=config)
    resumed.load_checkpoint(tmp_path)
    loaded = resumed.full_state_dict()
    assert [k for k in saved if not torch.equal(loaded[k], saved[k])] == []
    state, resumed_state = engine.optimizer.state_of(0), resumed.optimizer.state_of(0)
    assert all(torch.equal(state[k], resumed_state[k]) for k in ("exp_avg", "exp_avg_sq"))
