"""Checkpoints on gloo ranks: exact resume, resharding across world sizes and stages, consolidation,
a save that fails half-way, and a bad checkpoint rejected on every rank."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zerodp
from tests.dist.common import (assert_matches_reference, make_model, make_optimizer, optimizer_chunks, reference_run,
                               train_steps)
from zerodp.checkpoint import format as fmt
from zerodp.checkpoint import consolidate_main
from zerodp.tools.models.gpt import GPT, GPTConfig, lm_loss


GAS, CLIP, GLOBAL_ROWS = 2, 0.5, 12  # 12 rows: micro batches of 3 at world 2, of 2 at world 3


def config(stage: int, world: int, precision: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_ROWS // (world * GAS), "gradient_accumulation_steps": GAS,
           "gradient_clipping": CLIP,
           # small buckets: several units per group, so saved and loaded layouts cut parameters differently;
           # stage 3: vectors below 100 elements stay whole (persistent units; frozen.bias with no unit)
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200,
                                 "stage3_param_persistence_threshold": 100, "stage3_unit_min_params": 200}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine, first_step: int, steps: int, noise: bool) -> list[float]:
    return train_steps(engine, steps, engine.micro_batch_size, first_step, noise)


def params_of(engine) -> dict:
    """The full fp32 state dict on every rank (works at every stage, partitioned parameters included)."""
    return engine.full_state_dict(rank0_only=False)


def live_state(model, stage: int) -> dict:
    """The model's own state_dict, gathered first where its parameters are partitioned (stage 3)."""
    gather = contextlib.nullcontext()
    if stage == 3:
        from zerodp.shard.stage3 import gathered_parameters

        gather = gathered_parameters(list(model.parameters()))
    with gather:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- exact resume --------------------------------------------------------------------------------


def exact_resume_chunked(ckpt_dir: str, stage: int, opt_name: str, precision: str) -> dict:
    """`exact_resume` with the optimizer stepping 7-element chunks (state spans several chunks)."""
    with optimizer_chunks(7):
        return exact_resume(ckpt_dir, stage, opt_name, precision)


def exact_resume(ckpt_dir: str, stage: int, opt_name: str, precision: str) -> dict:
    world = dist.get_world_size()
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer(opt_name, model), config(stage, world, precision))
    torch.manual_seed(100 + dist.get_rank())  # a different noise stream on each rank
    train(engine, 0, 3, noise=True)
    path = engine.save_checkpoint(ckpt_dir, client_state={"epoch": 7})
    uninterrupted = train(engine, 3, 3, noise=True)

    resumed_model = make_model(seed=3)
    resumed = zerodp.initialize(resumed_model, make_optimizer(opt_name, resumed_model), config(stage, world, precision))
    torch.manual_seed(12345)  # the resumed run must not depend on the RNG state it happens to start with
    client = resumed.load_checkpoint(ckpt_dir)
    steps = (resumed.global_step, resumed.micro_step)
    return {"path": path, "client": client, "steps": steps, "uninterrupted": uninterrupted,
            "resumed": train(resumed, 3, 3, noise=True), "params": params_of(engine),
            "resumed_params": params_of(resumed)}


EXACT_CASES = [(0, "adamw", "fp32"), (1, "adamw", "fp32"), (2, "adamw", "fp32"), (2, "lamb", "fp32"),
               (1, "larc", "fp32"), (2, "sgd", "bf16"),
               (3, "adamw", "fp32"), (3, "sgd", "bf16")]


@pytest.mark.parametrize("stage,opt_name,precision", EXACT_CASES)
@pytest.mark.parametrize("world", [2, 3])
def test_exact_resume_is_bit_identical(dist_run, tmp_path, world, stage, opt_name, precision):
    assert_exact_resume(dist_run(world, exact_resume, str(tmp_path), stage, opt_name, precision), tmp_path)


@pytest.mark.parametrize("stage,opt_name", [(1, "larc"), (2, "adamw"), (2, "lamb"), (3, "adamw")])
@pytest.mark.parametrize("world", [3])
def test_exact_resume_with_optimizer_state_in_many_chunks(dist_run, tmp_path, world, stage, opt_name):
    assert_exact_resume(dist_run(world, exact_resume_chunked, str(tmp_path), stage, opt_name, "fp32"), tmp_path)


def assert_exact_resume(results, tmp_path) -> None:
    for rank, r in enumerate(results):
        assert r["path"] == str(tmp_path / "global_step3")
        assert r["client"] == {"epoch": 7}
        assert r["steps"] == (3, 3 * GAS)
        assert r["resumed"] == r["uninterrupted"], f"rank {rank}: losses differ after resume"
        for name, value in r["params"].items():
            assert torch.equal(r["resumed_params"][name], value), f"rank {rank}: {name} differs after resume"


# -- resharding: another world size, another stage -----------------------------------------------

FIRST, SECOND = 3, 3


def reshard_save(ckpt_dir: str, stage: int, chunk_numel: int = 0) -> list[float]:
    if chunk_numel:
        with optimizer_chunks(chunk_numel):
            return reshard_save(ckpt_dir, stage)
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config(stage, dist.get_world_size()))
    losses = train(engine, 0, FIRST, noise=False)
    engine.save_checkpoint(ckpt_dir)
    return losses


def reshard_load(ckpt_dir: str, stage: int, chunk_numel: int = 0) -> tuple[list[float], dict, int]:
    if chunk_numel:
        with optimizer_chunks(chunk_numel):
            return reshard_load(ckpt_dir, stage)
    model = make_model(seed=3)
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config(stage, dist.get_world_size()))
    engine.load_checkpoint(ckpt_dir)
    step = engine.global_step
    return train(engine, FIRST, SECOND, noise=False), params_of(engine), step


# (src world, src stage, dst world, dst stage, optimizer chunk elements when saving, when loading; 0: default)
RESHARD_CASES = [(2, 2, 3, 2, 0, 0), (3, 2, 2, 2, 0, 0), (2, 1, 3, 0, 0, 0), (3, 0, 2, 1, 0, 0),
                 (2, 2, 3, 3, 0, 0), (3, 3, 2, 2, 0, 0), (2, 2, 3, 2, 7, 5)]


@pytest.mark.parametrize("src_world,src_stage,dst_world,dst_stage,save_chunk,load_chunk", RESHARD_CASES)
def test_resume_at_another_world_size_and_stage_keeps_the_trajectory(dist_run, tmp_path, src_world, src_stage,
                                                                      dst_world, dst_stage, save_chunk, load_chunk):
    """The optimizer state survives resharding: the resumed run follows the uninterrupted trajectory
    (plain PyTorch on the same global batch) within the fp32 parity tolerance. Losing Adam's moments
    or its step count would move the first resumed update by ~lr, far outside it."""
    first = dist_run(src_world, reshard_save, str(tmp_path), src_stage, save_chunk)[0]
    results = dist_run(dst_world, reshard_load, str(tmp_path), dst_stage, load_chunk)
    ref_losses, ref_params = reference_run("adamw", FIRST + SECOND, GLOBAL_ROWS, CLIP)
    for rank, (second, params, step) in enumerate(results):
        assert step == FIRST
        assert_matches_reference(rank, first + second, params, ref_losses, ref_params, "after resharding")


# -- consolidation ---------------------------------------------------------------------------------


def consolidation_case(ckpt_dir: str, stage: int, precision: str) -> dict:
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config(stage, dist.get_world_size(), precision))
    train(engine, 0, 2, noise=False)
    engine.save_checkpoint(ckpt_dir, tag="final")
    return {"rank0_only": engine.full_state_dict(), "everywhere": engine.full_state_dict(rank0_only=False),
            "live": live_state(model, stage)}


@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (1, "bf16"), (0, "fp32"), (3, "fp32"), (3, "bf16")])
@pytest.mark.parametrize("world", [3])
def test_consolidation_equals_the_live_engine(dist_run, tmp_path, world, stage, precision):
    results = dist_run(world, consolidation_case, str(tmp_path), stage, precision)
    consolidated = zerodp.consolidate_checkpoint(tmp_path)  # no process group here
    full = results[0]["rank0_only"]
    assert all(r["rank0_only"] == {} for r in results[1:]), "rank0_only must leave other ranks empty"
    assert list(consolidated) == list(full) == list(results[0]["live"])
    for name, live in results[0]["live"].items():
        assert consolidated[name].dtype == (torch.float32 if live.is_floating_point() else live.dtype)
        assert torch.equal(consolidated[name], full[name]), name
        for r in results:
            assert torch.equal(r["everywhere"][name], full[name]), name
        if precision == "fp32":
            assert torch.equal(consolidated[name], live), name
        else:  # the model computes on the fp32 masters rounded to bf16
            assert torch.equal(consolidated[name].to(live.dtype), live), name
    # stage 3 partitions the frozen weight too: its values are saved in segments, not whole by rank 0
    meta = json.loads((tmp_path / "final" / "meta.json").read_text())
    assert ("frozen.weight" in meta["segments"]) == (stage == 3)
    assert "frozen.bias" not in meta["segments"]  # below the persistence threshold: whole on every rank


TINY_GPT = GPTConfig(vocab_size=48, block_size=16, n_layer=1, n_head=2, n_embd=16)


def gpt_engine(stage: int):
    model = GPT(TINY_GPT, seed=dist.get_rank())  # different on each rank: the engine broadcasts rank 0's
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                               {"train_micro_batch_size_per_gpu": 2,
                                "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                                      "stage3_param_persistence_threshold": 100}})
    return model, engine


def gpt_save(ckpt_dir: str, stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, engine = gpt_engine(stage)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2 * world, 9), generator=torch.Generator().manual_seed(5))
    mine = tokens[2 * rank:2 * rank + 2]
    for _ in range(2):
        engine.backward(lm_loss(engine(mine[:, :-1]), mine[:, 1:]))
        engine.step()
    engine.save_checkpoint(ckpt_dir)
    return live_state(model, stage)


def gpt_load(ckpt_dir: str, stage: int) -> dict:
    model, engine = gpt_engine(stage)
    engine.load_checkpoint(ckpt_dir)
    return live_state(model, stage)


@pytest.mark.parametrize("stage,load_stage", [(2, 3), (3, 2)])
@pytest.mark.parametrize("world", [2])
def test_gpt_with_tied_embeddings_round_trips(dist_run, tmp_path, world, stage, load_stage):
    live = dist_run(world, gpt_save, str(tmp_path / "ckpt"), stage)[0]
    sd = zerodp.consolidate_checkpoint(tmp_path / "ckpt")
    assert sd["lm_head.weight"] is sd["wte.weight"]  # one tensor under both names
    assert consolidate_main([str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")]) == 0
    for loaded in (sd, load_file(tmp_path / "model.safetensors"),
                   torch.load(zerodp.save_consolidated(tmp_path / "ckpt", tmp_path / "model.pt"), weights_only=True)):
        plain = GPT(TINY_GPT, seed=1)
        plain.load_state_dict(loaded, strict=True)
        assert plain.lm_head.weight is plain.wte.weight
        for name, value in plain.state_dict().items():
            assert torch.equal(value, live[name]), name
    # and back into an engine at another world size and stage, tied weights partitioned or not
    for rank, resumed in enumerate(dist_run(3, gpt_load, str(tmp_path / "ckpt"), load_stage)):
        for name, value in live.items():
            assert torch.equal(resumed[name], value), f"rank {rank}: {name}"


# -- failures ------------------------------------------------------------------------------------------


def save_fails_halfway(ckpt_dir: str) -> dict:
    """Rank 1 raises after its shard file and before its RNG file; the earlier checkpoint survives."""
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config(2, dist.get_world_size()))
    train(engine, 0, 1, noise=False)
    engine.save_checkpoint(ckpt_dir, tag="good")
    saved = params_of(engine)
    train(engine, 1, 1, noise=False)

    real_write_json = fmt.write_json

    def failing_write_json(path, obj):
        if dist.get_rank() == 1 and path.name.startswith("rng-"):
            raise OSError("No space left on device (simulated)")
        return real_write_json(path, obj)

    fmt.write_json = failing_write_json
    try:
        engine.save_checkpoint(ckpt_dir, tag="bad")
        error = None
    except zerodp.CheckpointError as err:
        error = str(err)
    finally:
        fmt.write_json = real_write_json
    dist.barrier()
    listing = sorted(p.name for p in Path(ckpt_dir).iterdir())
    fresh = make_model(seed=3)
    other = zerodp.initialize(fresh, make_optimizer("adamw", fresh), config(2, dist.get_world_size()))
    other.load_checkpoint(ckpt_dir)
    restored = params_of(other)
    return {"error": error, "listing": listing, "same": all(torch.equal(restored[k], v) for k, v in saved.items())}


@pytest.mark.parametrize("world", [2])
def test_save_killed_halfway_keeps_the_previous_checkpoint(dist_run, tmp_path, world):
    results = dist_run(world, save_fails_halfway, str(tmp_path))
    for r in results:
        assert "checkpoint 'bad' was not saved: rank 1 failed" in r["error"]
        assert "No space left on device (simulated)" in r["error"]
        assert r["listing"] == ["good", "latest"]
        assert r["same"]
    assert (tmp_path / "latest").read_text().strip() == "good"


def load_bad_checkpoint(ckpt_dir: str) -> dict:
    model = make_model(seed=3)
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config(2, dist.get_world_size()))
    before = params_of(engine)
    try:
        engine.load_checkpoint(ckpt_dir)
        error = None
    except zerodp.CheckpointError as err:
        error = str(err)
    after = params_of(engine)
    return {"error": error, "unchanged": all(torch.equal(after[k], v) for k, v in before.items())}


@pytest.mark.parametrize("world", [2])
def test_missing_rank_file_fails_on_every_rank_and_changes_nothing(dist_run, tmp_path, world):
    dist_run(world, reshard_save, str(tmp_path), 2)
    tag_dir = tmp_path / "global_step3"
    (tag_dir / fmt.shard_file(1, 2)).unlink()
    files_before = {p.name: p.read_bytes() for p in tag_dir.iterdir()}
    results = dist_run(world, load_bad_checkpoint, str(tmp_path))
    for r in results:
        assert "incomplete: shard-00001-of-00002.safetensors is missing" in r["error"]
        assert r["unchanged"]
    assert {p.name: p.read_bytes() for p in tag_dir.iterdir()} == files_before
    assert json.loads((tag_dir / "meta.json").read_text())["world_size"] == 2
