"""torch distributed checkpoint (DCP) both ways with FSDP2 (checkpoint/dcp.py), at another world size.

FSDP2 (`fully_shard`, gloo, CPU) on 2 ranks saves `{"model", "optimizer"}` from get_state_dict; zerodp on 3 ranks
at stages 1-3 loads it: masters, Adam exp_avg / exp_avg_sq and each parameter's step equal FSDP2's exactly
(torch.equal), and two more steps equal plain PyTorch continuing from that state. The other way: zerodp on 2 ranks
saves with `save_dcp`, FSDP2 on 3 ranks loads it with dcp.load and set_state_dict, the same checks. Also
torchtitan's layout (model keys at the top level, flattened optimizer state) and the refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zerodp
from zerodp.checkpoint import MASTER, CheckpointError, whole_param_value
from tests.dist.common import (assert_matches_reference, global_batch, make_model, make_optimizer, micro_batch,
                               train_steps)
from tests.oracle import train_reference

ROWS = 12            # the global batch: 6 rows per rank at world 2, 4 at world 3
BEFORE, AFTER = 3, 2  # steps before the checkpoint, steps after the resume
MOMENTS = ("exp_avg", "exp_avg_sq")
SAVED_LRS = (0.02, 0.005)  # set before saving: the loading side must take the groups' lr from the folder
TORCHTITAN_STEP = 10  # a train_state.step unlike the Adam steps, to see which one zerodp takes
SCHEDULE_STEPS = 6  # zerodp -> zerodp: enough for a few skipped fp16 steps and some taken


def config(stage: int, world: int, variant: str = "") -> dict:
    # small buckets and units: several per group, cut across parameters, so boxes start inside rows
    cfg = {"train_micro_batch_size_per_gpu": ROWS // world,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200,
                                 "stage3_param_persistence_threshold": 20, "stage3_unit_min_params": 200}}
    if variant == "offload":  # masters, moments (and at stage 3 the parameter shards) in host offload stores
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if variant == "bf16":  # bf16 compute, fp32 masters: the masters are what is exported
        cfg["bf16"] = {"enabled": True}
    return cfg


# -- FSDP2 side -----------------------------------------------------------------------------------------


def fsdp2_model(seed: int):
    model = make_model(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model.embed, model.frozen, model.hidden, model.out, model.unused):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, make_optimizer("adamw", model)


def fsdp2_train(model, opt, first_step: int, steps: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = micro_batch(step, 0, rank, world, ROWS // world, 1)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # FSDP2 averages gradients over ranks: equal rows per rank make it the global mean
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def fsdp2_full_state(model, opt) -> dict:
    """{"model": full state dict, "state": {fqn: {step, exp_avg, exp_avg_sq}}} (every rank)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": {k: v.detach().clone() for k, v in msd.items()},
            "state": {k: {kk: vv.detach().clone() for kk, vv in v.items()} for k, v in osd["state"].items()}}


def fsdp2_save(path: str, torchtitan: bool) -> dict:
    model, opt = fsdp2_model(seed=0)
    losses = fsdp2_train(model, opt, 0, BEFORE)
    for group, lr in zip(opt.param_groups, SAVED_LRS):
        group["lr"] = lr
    if torchtitan:  # torchtitan: the model's keys at the top level, the optimizer's flattened per parameter
        state = dict(get_model_state_dict(model))
        state["optimizer"] = get_optimizer_state_dict(model, opt,
                                                      options=StateDictOptions(flatten_optimizer_state_dict=True))
        state["train_state"] = {"step": torch.tensor(TORCHTITAN_STEP)}  # torchtitan's TrainState counter
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
    dcp.save(state, checkpoint_id=path)
    return {"losses": losses, "lrs": SAVED_LRS, **fsdp2_full_state(model, opt)}


def fsdp2_resume(path: str, torchtitan: bool) -> dict:
    model, opt = fsdp2_model(seed=1)  # another initialisation: everything must come from the checkpoint
    if torchtitan:
        msd = dict(get_model_state_dict(model))
        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        state = dict(msd, optimizer=osd)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict={k: state[k] for k in msd}, optim_state_dict=state["optimizer"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    loaded = fsdp2_full_state(model, opt)
    losses = fsdp2_train(model, opt, BEFORE, AFTER)
    return {"loaded": loaded, "losses": losses, "params": fsdp2_full_state(model, opt)["model"]}


# -- zerodp side ----------------------------------------------------------------------------------------


def zerodp_full_state(engine) -> dict:
    """The same form as `fsdp2_full_state`, from the engine's masters and optimizer state (every rank)."""
    model = engine.full_state_dict(rank0_only=False)
    steps = engine.optimizer.param_steps()
    state = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            state[name] = {"step": torch.tensor(float(steps[id(p)])),
                           "fp32": whole_param_value(engine, p, MASTER),
                           **{k: whole_param_value(engine, p, k) for k in MOMENTS}}
    return {"model": model, "state": state, "global_step": engine.global_step}


def zerodp_save(path: str, stage: int, model_key: str, variant: str = "") -> dict:
    model = make_model(0)
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config(stage, dist.get_world_size(), variant))
    losses = train_steps(engine, BEFORE, ROWS // dist.get_world_size())
    for group, lr in zip(engine.optimizer.param_groups, SAVED_LRS):
        group["lr"] = lr
    engine.save_dcp(path, model_key=model_key)
    out = {"losses": losses, "lrs": SAVED_LRS, **zerodp_full_state(engine)}
    engine.close()
    return out


def zerodp_resume(path: str, stage: int, variant: str = "") -> dict:
    model = make_model(1)
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config(stage, dist.get_world_size(), variant))
    engine.load_dcp(path)
    loaded = zerodp_full_state(engine)
    losses = train_steps(engine, AFTER, ROWS // dist.get_world_size(), first_step=BEFORE)
    out = {"loaded": loaded, "losses": losses, "params": engine.full_state_dict(rank0_only=False)}
    engine.close()
    return out


# -- the reference ----------------------------------------------------------------------------------------


def reference_from(state: dict) -> tuple[list[float], dict]:
    """The oracle (tests/oracle.py) continuing from `state` (fsdp2_full_state's form, and the groups' lrs) for
    AFTER steps: torch's AdamW given the saved moments and steps; a parameter without state starts fresh, as
    torch's would."""
    model = make_model(2)
    model.load_state_dict(state["model"])
    opt = make_optimizer("adamw", model)
    for group, lr in zip(opt.param_groups, state.get("lrs", ())):
        group["lr"] = lr
    for name, p in model.named_parameters():
        if name in state["state"]:
            saved = state["state"][name]
            opt.state[p] = {"step": saved["step"].clone().float(), **{k: saved[k].clone() for k in MOMENTS}}

    def step_loss(model, step):
        x, y = global_batch(BEFORE + step, ROWS)
        return F.mse_loss(model(x), y)

    ref = train_reference(model, opt, AFTER, step_loss)
    return ref.losses, ref.params


def assert_same_state(loaded: dict, saved: dict, what: str) -> None:
    """Parameters, buffers, Adam moments and steps bit for bit; a parameter the saver never stepped (no state
    in FSDP2, or step 0 in zerodp) has zero moments and step 0 on the loading side, or no state at all."""
    assert loaded["model"].keys() == saved["model"].keys(), what
    for key, value in saved["model"].items():
        assert torch.equal(loaded["model"][key], value), f"{what}: {key} differs"
    for name in set(saved["state"]) | set(loaded["state"]):
        mine, theirs = loaded["state"].get(name), saved["state"].get(name)
        if mine is None or theirs is None:  # never stepped on one side: absent there, zero on the other
            present = mine if mine is not None else theirs
            assert float(present["step"]) == 0 and all(not present[k].any() for k in MOMENTS), f"{what}: {name}"
            continue
        assert float(mine["step"]) == float(theirs["step"]), f"{what}: {name} step {mine['step']} vs {theirs['step']}"
        for k in MOMENTS:
            assert torch.equal(mine[k], theirs[k]), f"{what}: {name} {k} differs"


# -- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp2_checkpoints(tmp_path_factory):
    """FSDP2 on 2 ranks, 3 steps, saved in both layouts (made once for the module)."""
    out = {}
    for torchtitan in (False, True):
        path = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
        out[torchtitan] = path, zerodp_run_fsdp2_save(path, torchtitan)
    return out


def zerodp_run_fsdp2_save(path: str, torchtitan: bool) -> dict:
    from tests.dist import harness
    return harness.run(2, fsdp2_save, path, torchtitan)[0]


@pytest.mark.parametrize("stage,variant", [(1, ""), (2, ""), (3, ""), (3, "offload")])
def test_zerodp_resumes_an_fsdp2_checkpoint_at_another_world_size(dist_run, fsdp2_checkpoints, stage, variant):
    path, saved = fsdp2_checkpoints[False]
    results = dist_run(3, zerodp_resume, path, stage, variant)
    ref_losses, ref_params = reference_from(saved)
    for rank, got in enumerate(results):
        assert_same_state(got["loaded"], saved, f"rank {rank} stage {stage}")
        assert got["loaded"]["global_step"] == BEFORE  # the largest Adam step: FSDP2 keeps no step counter
        assert_matches_reference(rank, got["losses"], got["params"], ref_losses, ref_params, f"stage {stage}")


def test_zerodp_resumes_a_torchtitan_layout_checkpoint(dist_run, fsdp2_checkpoints):
    path, saved = fsdp2_checkpoints[True]
    results = dist_run(3, zerodp_resume, path, 2)
    ref_losses, ref_params = reference_from(saved)
    assert_same_state(results[0]["loaded"], saved, "torchtitan layout")
    assert results[0]["loaded"]["global_step"] == TORCHTITAN_STEP  # train_state.step wins over the Adam step
    assert_matches_reference(0, results[0]["losses"], results[0]["params"], ref_losses, ref_params, "torchtitan")


@pytest.mark.parametrize("stage,torchtitan,variant", [(1, False, ""), (2, False, ""), (3, False, ""), (3, True, ""),
                                                      (2, False, "offload"), (3, False, "offload"), (2, False, "bf16")])
def test_fsdp2_loads_a_zerodp_checkpoint_at_another_world_size(dist_run, tmp_path, stage, torchtitan, variant):
    path = str(tmp_path / "ckpt")
    saved = dist_run(2, zerodp_save, path, stage, "" if torchtitan else "model", variant)[0]
    metadata = dcp.FileSystemReader(path).read_metadata()
    files = {metadata.storage_data[index].relative_path for index in metadata.storage_data
             if index.fqn == ("" if torchtitan else "model.") + "hidden.weight"}
    assert len(files) == 2, files  # each rank wrote its own part of the parameter (no gather to rank 0)
    results = dist_run(3, fsdp2_resume, path, torchtitan)
    ref_losses, ref_params = reference_from(saved)
    for rank, got in enumerate(results):
        assert_same_state(got["loaded"], saved, f"rank {rank} stage {stage}")
        assert_matches_reference(rank, got["losses"], got["params"], ref_losses, ref_params, f"stage {stage}")


def refusals(work: str) -> dict:
    """FSDP2 writes a model-only folder and one that lacks a parameter; zerodp's load_dcp refuses both, and a
    folder that is not a DCP checkpoint, each with its fix; the model-only folder loads with load_optimizer=False."""
    model, opt = fsdp2_model(seed=0)
    fsdp2_train(model, opt, 0, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd}, checkpoint_id=f"{work}/model_only")
    dcp.save({"model": {k: v for k, v in msd.items() if k != "hidden.weight"}, "optimizer": osd},
             checkpoint_id=f"{work}/no_hidden")
    full = fsdp2_full_state(model, opt)["model"]
    zmodel = make_model(1)
    engine = zerodp.initialize(zmodel, make_optimizer("adamw", zmodel), config(2, dist.get_world_size()))
    before = engine.full_state_dict(rank0_only=False)
    messages = {}
    for case in ("model_only", "no_hidden", "not_there"):
        with pytest.raises(CheckpointError) as err:
            engine.load_dcp(f"{work}/{case}")
        messages[case] = str(err.value)
    unchanged = engine.full_state_dict(rank0_only=False)
    engine.load_dcp(f"{work}/model_only", load_optimizer=False)
    out = {"messages": messages, "before": before, "unchanged": unchanged, "full": full,
           "loaded": engine.full_state_dict(rank0_only=False)}
    engine.close()
    return out


def test_a_folder_without_what_zerodp_needs_is_refused_with_the_fix(dist_run, tmp_path):
    got = dist_run(2, refusals, str(tmp_path))[0]
    messages = got["messages"]
    assert "holds no optimizer state" in messages["model_only"] and "load_optimizer=False" in messages["model_only"]
    assert "missing keys (1): model.hidden.weight" in messages["no_hidden"] and "model_key=" in messages["no_hidden"]
    assert "is not a torch distributed checkpoint" in messages["not_there"]
    for key, value in got["before"].items():  # a refused load changed nothing
        assert torch.equal(got["unchanged"][key], value), key
    for key, value in got["full"].items():  # the weights alone load exactly
        assert torch.equal(got["loaded"][key], value), key


def zerodp_schedule_round_trip(path: str, save: bool) -> dict:
    """zerodp's own export carries its counters and lr schedule (WarmupLR) to zerodp at another world size."""
    world = dist.get_world_size()
    cfg = dict(config(3 if save else 1, world),
               scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 10}},
               # fp16 from a loss scale of 2^20: the first steps overflow and are skipped, so the skipped-step
               # count and the dynamic loss scale are not their defaults when saved
               fp16={"enabled": True, "initial_scale_power": 20})
    model = make_model(0 if save else 1)
    engine = zerodp.initialize(model, make_optimizer("adamw", model), cfg)
    if save:
        train_steps(engine, SCHEDULE_STEPS, ROWS // world)
        engine.save_dcp(path)
    else:
        engine.load_dcp(path)
    out = {"global_step": engine.global_step, "lr": engine.get_lr(), "skipped": engine.skipped_steps,
           "scaler": engine.scaler.state_dict(), **zerodp_full_state(engine)}
    losses = train_steps(engine, AFTER, ROWS // world, first_step=SCHEDULE_STEPS)
    out.update(losses=losses, params=engine.full_state_dict(rank0_only=False), lr_after=engine.get_lr())
    engine.close()
    return out


def test_zerodp_export_carries_its_counters_and_lr_schedule(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = dist_run(2, zerodp_schedule_round_trip, path, True)[0]
    got = dist_run(3, zerodp_schedule_round_trip, path, False)[0]
    assert got["global_step"] == saved["global_step"] == SCHEDULE_STEPS, (got["global_step"], saved["global_step"])
    assert got["skipped"] == saved["skipped"] > 0, saved["skipped"]
    assert got["scaler"] == saved["scaler"], (got["scaler"], saved["scaler"])
    assert got["lr"] == saved["lr"] and 0 < saved["lr"][0] < 0.01, saved["lr"]  # mid-warmup: the position came along
    assert_same_state(got, saved, "zerodp -> zerodp")
    assert got["lr_after"] != got["lr"]  # and it goes on stepping
