"""offload_optimizer with whole-tensor optimizers (Muon + AdamW, Adafactor): the state shaped like its
parameter (Muon's momentum, Adafactor's moment of a vector) streams through the step in windows; the
rest (Adafactor's row/column moments, scalars) stays resident ([Note: whole-tensor chunks] in
offload/optimizer_state.py). The result is bitwise the run without offload, which matches plain PyTorch."""

from __future__ import annotations

import pytest
import torch

import zerodp
from tests.dist.common import assert_matches_reference
from tests.dist.whole_tensor_common import (
    config,
    make_gpt,
    make_optimizers,
    reference_run,
    register,
    train,
)

STEPS = 3


def run(name: str, stage: int, offload: dict | None) -> tuple[list[float], dict, dict]:
    import torch.distributed as dist

    register()
    zero = {"stage3_unit_modules": ["Block"]} if stage == 3 else {}
    if offload is not None:
        zero.update(offload_optimizer=offload, sub_group_size=300)  # several windows; matrices (784) alone
    model = make_gpt()
    engine = zerodp.initialize(model, make_optimizers(name, model), config(stage, dist.get_world_size(), **zero))
    losses = train(engine, 0, STEPS)
    facts = {}
    if engine.optimizer.offload is not None:
        store = engine.optimizer.offload
        facts = {"windows": len(store.windows), "streamed": sorted(store.keys), "disk_bytes": store.disk_bytes(),
                 "report": engine.memory_report().as_dict()}
    params = engine.full_state_dict(rank0_only=False)
    engine.close()
    return losses, params, facts


def offload_vs_plain(nvme_dir: str, name: str, stage: int, device: str) -> dict:
    section = {"device": device, "buffer_count": 2}
    if device == "nvme":
        section["nvme_path"] = nvme_dir
    return {"plain": run(name, stage, None), "offloaded": run(name, stage, section)}


@pytest.mark.parametrize("name, stage, device", [("muon_fp32", 2, "cpu"), ("muon_fp32", 3, "nvme"),
                                                 ("adafactor", 1, "nvme"), ("adafactor", 3, "cpu")])
def test_whole_tensor_offload_is_bitwise_the_run_without_it(dist_run, tmp_path, name, stage, device):
    ref_losses, ref_params = reference_run(name, STEPS)
    for rank, r in enumerate(dist_run(2, offload_vs_plain, str(tmp_path), name, stage, device)):
        (plain_losses, plain_params, _), (losses, params, facts) = r["plain"], r["offloaded"]
        assert losses == plain_losses, f"rank {rank}: losses differ with offload"
        for key, value in plain_params.items():
            assert torch.equal(params[key], value), f"rank {rank}: {key} differs with offload"
        assert_matches_reference(rank, losses, params, ref_losses, ref_params, "(offloaded) vs PyTorch")
        assert facts["windows"] > 1, "the step should stream several windows"
        # Muon's momentum buffers (and AdamW's moments) stream; Adafactor streams its vectors' moments
        expected = {"momentum_buffer"} if name == "muon_fp32" else {"variance"}
        assert expected <= set(facts["streamed"]), facts
        assert (facts["disk_bytes"] > 0) == (device == "nvme"), facts
        # memory_report predicts the streamed regions (one per state name over the stream), the I/O slots
        # (grown to a whole matrix) and the resident factored moments, to the byte
        report = facts["report"]
        assert report["optimizer_bytes"] == report["optimizer_bytes_predicted"], report
        assert report["disk_bytes"] == report["disk_bytes_predicted"] == facts["disk_bytes"], report


def offload_resume(nvme_dir: str, ckpt_dir: str, name: str, stage: int, device: str) -> dict:
    """Save an offloaded whole-tensor run mid-way and resume it in a new engine (offloaded too)."""
    import torch.distributed as dist

    register()
    zero = {"stage3_unit_modules": ["Block"]} if stage == 3 else {}
    section = {"device": device, "buffer_count": 2}
    if device == "nvme":
        section["nvme_path"] = nvme_dir
    zero.update(offload_optimizer=section, sub_group_size=300)
    cfg = config(stage, dist.get_world_size(), **zero)
    model = make_gpt()
    engine = zerodp.initialize(model, make_optimizers(name, model), cfg)
    train(engine, 0, 2)
    engine.save_checkpoint(ckpt_dir, tag="mid")
    uninterrupted = train(engine, 2, 2)
    engine.close()
    fresh = make_gpt()
    resumed = zerodp.initialize(fresh, make_optimizers(name, fresh), cfg)
    resumed.load_checkpoint(ckpt_dir, tag="mid")
    losses = train(resumed, 2, 2)
    resumed.close()
    return {"uninterrupted": uninterrupted, "resumed": losses}


@pytest.mark.parametrize("name, stage, device", [("muon_fp32", 3, "nvme"), ("adafactor", 1, "cpu")])
def test_whole_tensor_offload_checkpoint_resumes_exactly(dist_run, tmp_path, name, stage, device):
    """The state that streams (Muon's momentum, Adafactor's vector moments) lives in the offload store
    between steps; a checkpoint must read it from there and a load must put it back there."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    for rank, r in enumerate(dist_run(2, offload_resume, str(nvme), str(tmp_path / "ckpt"), name, stage, device)):
        assert r["resumed"] == r["uninterrupted"], f"rank {rank}: {r}"
