"""ZeRO over the data-parallel group of a TP 2 x DP 2 layout equals the single-process unsharded model.

On 4 gloo ranks (one launch for every case): the tensor-parallel GPT with dropout (the model-parallel RNG
tracker), gradient accumulation and clipping on every step, at ZeRO stages 1, 2 and 3, against the
reference of tensor_parallel_common.py: losses of every (tp, dp) rank, the gradient norm of every step
(the rule: tensor-parallel shards summed over TP ranks, replicated parameters once) and the parameters,
gathered to the unsharded shapes; the same with every block's activation checkpoint partitioned over the
tensor-parallel group and kept in host memory (Pa+cpu). Then a checkpoint written per (tp, dp) rank resumes
bitwise, loads at one data-parallel rank (2 ranks), is refused at another tensor-parallel size, and its
consolidation merges into the unsharded model; the DeepSpeed adapter's mpu= and an fp16 overflow on one
tensor-parallel rank.
"""

import itertools
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.dist.common import assert_adam_params_close, assert_trained
from tests.dist.tensor_parallel_common import CFG, DP, MICRO_BS, SEED, TP, TPRun, config, reference_run, unsharded
from zerodp.activations import DEVICE, HOST
from zerodp.checkpoint.consolidate import consolidate_tensor_parallel, save_consolidated
import zerodp
from zerodp.errors import CheckpointError
from zerodp.tools.models.gpt import GPT
from zerodp.tools.models.tp_gpt import TensorParallelGPT
from zerodp.tensor_parallel import ModelParallelUnit

STEPS = 3
CASES = [(1, "adamw", {}), (2, "sgd", {}), (3, "adamw", {"stage3_unit_min_params": 1})]


# ZeRO-R beside it: every block checkpointed through deepspeed.checkpointing, its input partitioned over the
# tensor-parallel group (Pa) and kept in host memory (cpu), the recomputation drawing the forward's dropout
PA_CPU = {"partition_activations": True, "cpu_checkpointing": True}


def train_cases() -> dict:
    """Every stage's run on this rank, without and with Pa+cpu: {"train" | "Pa+cpu": {stage: (losses, norms,
    this tp rank's full state dict on dp rank 0, specs)}}."""
    variants = {"train": None, "Pa+cpu": PA_CPU}
    out = {key: {} for key in variants}
    for stage, opt_name, zero in CASES:
        # Both engines of a stage live at once: two communicators over the same data-parallel ranks (stage 3's
        # reduction communicator), each its own; a closed one is kept for the next engine over those ranks
        # ([Note: local communicators] in comm/local_groups.py; tests/dist/test_local_groups.py).
        runs = {key: TPRun(stage, opt_name, activation_checkpointing=ac, **zero) for key, ac in variants.items()}
        for key, run in runs.items():
            run.reseed()  # the other run's construction seeded the generators too
            losses, norms = run.train(range(STEPS))
            out[key][stage] = (losses, norms, run.engine.full_state_dict(), run.specs)
        kept = _kept_bytes()
        # Pa+cpu: each block's input (micro-batch x block_size x n_embd fp32) kept in host memory, half per
        # tensor-parallel rank; both blocks' at once at the peak, none on the device
        half_input = MICRO_BS * CFG.block_size * CFG.n_embd * 4 // TP
        assert kept.peak[HOST] == CFG.n_layer * half_input and kept.peak[DEVICE] == 0, kept
        for run in runs.values():
            run.close()
    return out


def checkpoint_case(root: str) -> dict:
    """Stage 2: 2 steps, save (with the tracker's streams as client_state), 1 more step; a fresh engine loads
    the checkpoint and takes the same step. Rank 0 also consolidates the checkpoint."""
    run = TPRun(2, "adamw")
    run.train(range(2))
    saved_full = run.engine.full_state_dict()
    run.engine.save_checkpoint(root, tag="s2", client_state={"tracker": run.tracker.get_states()})
    cont_losses, _ = run.train(range(2, 3))
    cont = run.engine.full_state_dict()
    run.close()
    fresh = TPRun(2, "adamw")
    client = fresh.engine.load_checkpoint(root, tag="s2")
    fresh.tracker.set_states(client["tracker"])
    resumed_losses, _ = fresh.train(range(2, 3))
    resumed = fresh.engine.full_state_dict()
    specs = fresh.specs
    fresh.close()
    consolidated = None
    if torch.distributed.get_rank() == 0:  # from the layout recorded at save time, and given the model's specs
        consolidated = consolidate_tensor_parallel(root, tag="s2")
        given = consolidate_tensor_parallel(root, specs, tag="s2")
        assert all(torch.equal(consolidated[k], given[k]) for k in given)
    return {"cont": (cont_losses, cont), "resumed": (resumed_losses, resumed), "saved": saved_full,
            "consolidated": consolidated}


def reload_at_one_data_parallel_rank(root: str) -> dict:
    """On 2 ranks (TP 2 x DP 1): the TP 2 x DP 2 checkpoint loads at another data-parallel size; a run at
    tensor-parallel size 1 is refused, naming the saved size."""
    run = TPRun(2, "adamw")
    run.engine.load_checkpoint(root, tag="s2")
    loaded = run.engine.full_state_dict()
    run.close()
    mpu = ModelParallelUnit(1)
    model = TensorParallelGPT(CFG, mpu, seed=SEED)
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), config(2), mpu=mpu)
    try:
        engine.load_checkpoint(root, tag="s2")
        refusal = None
    except CheckpointError as err:
        refusal = str(err)
    engine.close()
    mpu.destroy()
    return {"loaded": loaded, "refusal": refusal}


def _kept_bytes():
    from zerodp.activations import PROCESS

    return PROCESS.checkpointer.kept_bytes


def deepspeed_case() -> dict:
    """Stage 1 through zerodp.deepspeed.initialize(mpu=...): the same run as zerodp.initialize's, and
    DeepSpeed's rank getters read the 2-D layout."""
    run = TPRun(1, "adamw", via_deepspeed=True)
    losses, norms = run.train(range(STEPS))
    e = run.engine
    getters = (e.global_rank, e.world_size, e.dp_world_size, e.mp_world_size)
    from zerodp.adapters.deepspeed import zero

    # zero.Init(mpu=) creates stage-3 parameters partitioned over the same data-parallel group
    assert zero.Init(config_dict_or_path=config(3), mpu=run.mpu).group is run.mpu.get_data_parallel_group()
    full = e.engine.full_state_dict()
    run.close()
    return {"losses": losses, "norms": norms, "full": full, "getters": getters}


def overflow_case() -> dict:
    """fp16, stage 2: on the first step an inf reaches a gradient on tensor-parallel rank 1 only; every rank
    of both groups skips it, so the scales and the tensor-parallel copies stay alike."""
    run = TPRun(2, "adamw", extra={"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}})
    if run.mpu.get_tensor_model_parallel_rank() == 1:
        poisoned = {"left": 1}

        def poison(grad):
            if poisoned["left"]:
                poisoned["left"] -= 1
                return torch.full_like(grad, float("inf"))
            return grad

        run.model.blocks[0].mlp.fc.weight.register_hook(poison)
    before = {k: v.detach().float().clone() for k, v in run.model.named_parameters()}
    run.train(range(1))
    unchanged = all(torch.equal(before[k], v.detach().float()) for k, v in run.model.named_parameters())
    scale_after_skip = run.engine.loss_scale
    run.train(range(1, 2))
    out = {"unchanged": unchanged, "scale_after_skip": scale_after_skip, "skipped": run.engine.skipped_steps,
           "ln_f": run.model.ln_f.weight.detach().float().clone()}
    run.close()
    return out


def all_cases(root: str) -> dict:
    return {**train_cases(), "checkpoint": checkpoint_case(root), "deepspeed": deepspeed_case(),
            "overflow": overflow_case()}


def test_tp2_dp2_equals_unsharded(dist_run):
    with tempfile.TemporaryDirectory() as root:
        results = dist_run(TP * DP, all_cases, root, timeout=300)
        reloaded = dist_run(TP, reload_at_one_data_parallel_rank, root)
        # `zerodp consolidate`'s writer: the merged model in one file
        merged_file = load_file(str(save_consolidated(root, Path(root) / "merged.safetensors", tag="s2")))
    init = dict(TensorParallelGPT(CFG, seed=SEED).named_parameters())
    for (stage, opt_name, _), kind in itertools.product(CASES, ("train", "Pa+cpu")):
        ref_losses, ref_norms, ref_params = reference_run(opt_name, STEPS)
        assert_trained(ref_params, init, by=1e-3)
        for rank, result in enumerate(results):
            losses, norms, _, _ = result[kind][stage]
            tp, dp = rank % TP, rank // TP
            where = f"{kind} stage {stage} rank {rank} (tp {tp}, dp {dp})"
            # fp32 losses of order 3, summed in another order: ~1e-7 relative; rtol 1e-5 leaves x100
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[dp]), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{where}: losses: {m}")
            # the norm decides the clip coefficient on every step: a replicated parameter counted twice
            # changes it by far more than rtol 1e-5
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{where}: gradient norms: {m}")
        _, _, sd0, specs = results[0][kind][stage]
        params = unsharded([results[t][kind][stage][2] for t in range(TP)], specs)
        assert set(params) >= set(ref_params)
        if opt_name == "sgd":  # the update is lr * clipped gradient: rtol 1e-5 of the value, 1e-6 near zero
            for key, ref in ref_params.items():
                torch.testing.assert_close(params[key], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{kind} stage {stage} {key}: {m}")
        else:
            assert_adam_params_close(params, ref_params, 1e-2, STEPS, where=f"{kind} stage {stage}")

    ckpt = [r["checkpoint"] for r in results]
    for rank in range(TP * DP):
        cont_losses, _ = ckpt[rank]["cont"]
        resumed_losses, _ = ckpt[rank]["resumed"]
        assert resumed_losses == cont_losses, f"rank {rank}: resumed losses {resumed_losses} != {cont_losses}"
    for t in range(TP):  # dp rank 0 of each tp rank holds its tp rank's full state dict
        cont, resumed = ckpt[t]["cont"][1], ckpt[t]["resumed"][1]
        for key in cont:
            assert torch.equal(cont[key], resumed[key]), f"tp rank {t}: {key} differs after resuming"
    saved = unsharded([ckpt[t]["saved"] for t in range(TP)], results[0]["train"][1][3])
    consolidated = ckpt[0]["consolidated"]
    assert set(consolidated) == set(saved)
    for key in saved:
        assert torch.equal(consolidated[key], saved[key]), f"consolidated {key} is not the saved model's"
    assert consolidated["blocks.0.attn.qkv.weight"].shape == (3 * CFG.n_embd, CFG.n_embd)
    assert set(merged_file) == set(saved) and all(torch.equal(merged_file[k], saved[k]) for k in saved)
    for t in range(TP):  # at one data-parallel rank, each tensor-parallel rank holds what TP 2 x DP 2 saved
        assert all(torch.equal(reloaded[t]["loaded"][k], ckpt[t]["saved"][k]) for k in ckpt[t]["saved"])
        assert "saved at tensor-parallel size 2, this run has 1" in reloaded[t]["refusal"]
    gpt = GPT(CFG)  # the merged model is gpt.py's GPT (its lm_head.weight is the tied wte.weight)
    loaded = gpt.load_state_dict(merged_file, strict=False)
    assert loaded.missing_keys == ["lm_head.weight"] and not loaded.unexpected_keys
    assert torch.equal(gpt.lm_head.weight, merged_file["wte.weight"])

    for rank, result in enumerate(results):  # zerodp.deepspeed.initialize(mpu=) runs zerodp.initialize(mpu=)'s steps
        ds, own = result["deepspeed"], result["train"][1]
        assert ds["losses"] == own[0] and ds["norms"] == own[1], f"rank {rank}: the adapter's run differs"
        assert ds["getters"] == (rank, TP * DP, DP, TP), f"rank {rank}: global_rank, world, dp, mp: {ds['getters']}"
    for t in range(TP):
        assert all(torch.equal(results[t]["deepspeed"]["full"][k], results[t]["train"][1][2][k])
                   for k in results[t]["train"][1][2])

    for rank, result in enumerate(results):  # fp16: one tensor-parallel rank's inf skips the step everywhere
        o = result["overflow"]
        assert o["unchanged"] and o["skipped"] == 1 and o["scale_after_skip"] == 128.0, f"rank {rank}: {o}"
        # the replicated LayerNorm took the same later step on every rank
        assert torch.equal(o["ln_f"], results[0]["overflow"]["ln_f"]), f"rank {rank}: ln_f diverged"
