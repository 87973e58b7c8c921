"""Optimizer offload (ZeRO-Offload: cpu; ZeRO-Infinity: nvme) changes where the optimizer state lives,
never the result: stages 1-3, fp32, world sizes 2 and 3, with accumulation and clipping, give bitwise
the same losses and parameters as the same run without offload (which itself matches plain PyTorch:
checked here too). Small sub_group_size values make the step stream many windows, and buffer_count 1
and 2 exercise the pipeline without and with read-ahead. Checkpoints of offloaded runs resume without
offload and the reverse, exactly; the rank folders are gone after engine.close().
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.dist.common import make_model, make_optimizer, train_steps
from tests.dist.test_parity import CLIP, GAS, MICRO_BS, STEPS, assert_parity


def config(stage: int, offload: dict | None = None, sub_group_size: int = 1_000_000_000) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200, "sub_group_size": sub_group_size,
            "stage3_param_persistence_threshold": 30, "stage3_unit_min_params": 200}
    if stage == 3:  # bucket sizes do not apply at stage 3 (and warn)
        del zero["reduce_bucket_size"], zero["allgather_bucket_size"]
    if offload is not None:
        zero["offload_optimizer"] = offload
    return {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "zero_optimization": zero}


def offload_section(device: str, nvme_dir: str, buffer_count: int) -> dict:
    section = {"device": device, "buffer_count": buffer_count}
    if device == "nvme":
        section["nvme_path"] = nvme_dir
    return section


def run(cfg: dict, opt_name: str, steps: int = STEPS) -> tuple[list[float], dict, dict]:
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer(opt_name, model), cfg)
    losses = train_steps(engine, steps, MICRO_BS)
    params = engine.full_state_dict(rank0_only=False)
    facts = {}
    if engine.optimizer.offload is not None:
        state = engine.optimizer.offload
        facts = {"windows": len(state.windows), "disk_bytes": state.disk_bytes()}
        folder = state.file_store.rank_dir.path if state.file_store is not None else None
        facts["files"] = sorted(os.listdir(folder)) if folder else []
        engine.close()
        facts["folder_removed"] = folder is None or not folder.exists()
    return losses, params, facts


def offload_vs_plain(nvme_dir: str, stage: int, opt_name: str, device: str, sub_group_size: int,
                     buffer_count: int) -> dict:
    plain = run(config(stage), opt_name)
    offloaded = run(config(stage, offload_section(device, nvme_dir, buffer_count), sub_group_size), opt_name)
    return {"plain": plain, "offloaded": offloaded}


CASES = [(1, "adamw", "nvme", 40, 2), (2, "adamw", "nvme", 64, 1), (3, "adamw", "nvme", 50, 3),
         (1, "sgd", "cpu", 40, 4), (2, "adamw", "cpu", 1_000_000_000, 4), (3, "sgd", "nvme", 33, 2),
         (3, "adamw", "cpu", 45, 2), (3, "adamw_fused", "nvme", 50, 2)]


@pytest.mark.parametrize("stage,opt_name,device,sub_group_size,buffer_count", CASES)
@pytest.mark.parametrize("world", [2, 3])
def test_offload_is_bitwise_identical_to_no_offload(dist_run, tmp_path, world, stage, opt_name, device,
                                                    sub_group_size, buffer_count):
    results = dist_run(world, offload_vs_plain, str(tmp_path), stage, opt_name, device, sub_group_size, buffer_count)
    for rank, r in enumerate(results):
        (plain_losses, plain_params, _), (losses, params, facts) = r["plain"], r["offloaded"]
        assert losses == plain_losses, f"rank {rank}: losses differ with offload"
        for name, value in plain_params.items():
            assert torch.equal(params[name], value), f"rank {rank}: {name} differs with offload"
        if sub_group_size < 1000:
            assert facts["windows"] > 1, "the step should stream several windows"
        if device == "nvme":
            n_states = 2 if opt_name.startswith("adamw") else 1
            assert facts["disk_bytes"] > 0 and len(facts["files"]) == n_states + 1  # + owner.json
        assert facts["folder_removed"]
    assert_parity([(r["offloaded"][0], r["offloaded"][1]) for r in results], opt_name, world)
    assert list(tmp_path.iterdir()) == []  # every rank folder and the run folder are gone


# -- checkpoints: the same format with and without offload --------------------------------------


def resume_across(ckpt_dir: str, nvme_dir: str, stage: int, save_offload: bool) -> dict:
    offload = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 2}
    save_cfg = config(stage, offload if save_offload else None, sub_group_size=37)
    load_cfg = config(stage, None if save_offload else offload, sub_group_size=37)
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("adamw", model), save_cfg)
    train_steps(engine, 3, MICRO_BS)
    engine.save_checkpoint(ckpt_dir)
    uninterrupted = train_steps(engine, 3, MICRO_BS, first_step=3)
    expected = engine.full_state_dict(rank0_only=False)
    engine.close()
    other = make_model(seed=5)
    resumed = zerodp.initialize(other, make_optimizer("adamw", other), load_cfg)
    resumed.load_checkpoint(ckpt_dir)
    losses = train_steps(resumed, 3, MICRO_BS, first_step=3)
    got = resumed.full_state_dict(rank0_only=False)
    resumed.close()
    dist.barrier()
    return {"uninterrupted": uninterrupted, "resumed": losses,
            "same": all(torch.equal(got[k], v) for k, v in expected.items())}


@pytest.mark.parametrize("save_offload", [True, False])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_resumes_across_offload_exactly(dist_run, tmp_path, world, stage, save_offload):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = dist_run(world, resume_across, str(tmp_path / "ckpt"), str(nvme), stage, save_offload)
    for rank, r in enumerate(results):
        assert r["resumed"] == r["uninterrupted"], f"rank {rank}: losses differ after resume"
        assert r["same"], f"rank {rank}: parameters differ after resume"
