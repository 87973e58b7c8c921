"""Parameter offload (`offload_param`, stage 3) changes where the parameter shards live, never the result:
fp32, world sizes 2 and 3, with accumulation and clipping, alone and together with offload_optimizer
nvme, give bitwise the same losses and parameters as the run without offload (which itself matches
plain PyTorch: checked too). A tiny max_in_cpu forces every shard out to its file and back many times
per step (reads ahead, dirty write-backs); buffer_count 1 and 3 vary the read-ahead. Checkpoints of
such runs resume with and without offload exactly; the rank folders are gone after engine.close().
In fp32 the gradient shards live in files too ([Note: gradient shards offloaded]); in bf16 they stay.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.dist.common import make_model, make_optimizer, train_steps
from tests.dist.test_offload import config
from tests.dist.test_parity import MICRO_BS, STEPS, assert_parity


def param_section(nvme_dir: str, max_in_cpu: int, buffer_count: int) -> dict:
    return {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": max_in_cpu, "buffer_count": buffer_count}


def make_config(nvme_dir: str, max_in_cpu: int | None, buffer_count: int, with_optimizer: bool) -> dict:
    optimizer = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 2} if with_optimizer else None
    cfg = config(3, optimizer, sub_group_size=41)
    if max_in_cpu is not None:
        cfg["zero_optimization"]["offload_param"] = param_section(nvme_dir, max_in_cpu, buffer_count)
    return cfg


def run(cfg: dict, opt_name: str) -> tuple[list[float], dict, dict]:
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer(opt_name, model), cfg)
    losses = train_steps(engine, STEPS, MICRO_BS)
    params = engine.full_state_dict(rank0_only=False)
    facts = {}
    home, grads = engine.sharding.param_home, engine.sharding.grad_home  # the stage-3 strategy's stores
    if home.offloads:
        facts = {"shards": len(home.entries), "disk_bytes": home.disk_bytes(), "read_bytes": home.read_bytes,
                 "peak_resident_numel": home.peak_resident_numel, "folder": home.rank_dir.path,
                 "grad_shards": len(grads.entries) if grads is not None else 0,
                 "grad_disk_bytes": grads.disk_bytes() if grads is not None else 0,
                 "grad_peak_resident_numel": grads.peak_resident_numel if grads is not None else 0,
                 "sharded_trainable": [u.grad_shard.numel() * 4 for u in engine.units if not u.persistent],
                 # after the last step's zero_grad the gradient files hold no disk blocks (sparse)
                 "grad_blocks": _blocks(grads) if grads is not None else None, "param_blocks": _blocks(home)}
    engine.close()
    if home.offloads:
        facts["folder_removed"] = not facts.pop("folder").exists()
    return losses, params, facts


def _blocks(store) -> int:
    """512-byte disk blocks the store's files hold now."""
    return sum(os.fstat(fd).st_blocks for e in store.entries.values() for fd in e.backing.fds.values())


def param_offload_vs_plain(nvme_dir: str, opt_name: str, max_in_cpu: int, buffer_count: int,
                           with_optimizer: bool, bf16: bool = False) -> dict:
    configs = [make_config(nvme_dir, None, buffer_count, False),
               make_config(nvme_dir, max_in_cpu, buffer_count, with_optimizer)]
    for cfg in configs:
        if bf16:
            cfg["bf16"] = {"enabled": True}
    return {"plain": run(configs[0], opt_name), "offloaded": run(configs[1], opt_name)}


CASES = [("adamw", 0, 1, False), ("adamw", 150, 3, True), ("sgd", 80, 2, False), ("adamw", 10**9, 2, True)]


@pytest.mark.parametrize("opt_name,max_in_cpu,buffer_count,with_optimizer", CASES)
@pytest.mark.parametrize("world", [2, 3])
def test_param_offload_is_bitwise_identical_to_no_offload(dist_run, tmp_path, world, opt_name, max_in_cpu,
                                                          buffer_count, with_optimizer):
    results = dist_run(world, param_offload_vs_plain, str(tmp_path), opt_name, max_in_cpu, buffer_count,
                       with_optimizer)
    for rank, r in enumerate(results):
        (plain_losses, plain_params, _), (losses, params, facts) = r["plain"], r["offloaded"]
        assert losses == plain_losses, f"rank {rank}: losses differ with offload_param"
        for name, value in plain_params.items():
            assert torch.equal(params[name], value), f"rank {rank}: {name} differs with offload_param"
        assert facts["shards"] >= 3 and facts["disk_bytes"] > 0
        # fp32: the gradient shard of every sharded trainable unit lives in a file of its own
        assert facts["grad_shards"] == len(facts["sharded_trainable"]) >= 3
        assert facts["grad_disk_bytes"] == sum(facts["sharded_trainable"])
        # at most one partly covered file-system block per file stays (these shards are smaller than one)
        assert facts["grad_blocks"] * 512 <= 4096 * facts["grad_shards"]
        assert facts["param_blocks"] * 512 >= facts["disk_bytes"] - facts["grad_disk_bytes"]
        if max_in_cpu < 10**9:
            # every step reads every shard back (forward, backward, optimizer): far more than one copy
            assert facts["read_bytes"] > 3 * STEPS * facts["disk_bytes"] / 2
        assert facts["folder_removed"]
    assert_parity([(r["offloaded"][0], r["offloaded"][1]) for r in results], opt_name, world)
    assert list(tmp_path.iterdir()) == []


def test_param_offload_in_bf16_is_bitwise_identical_to_no_offload(dist_run, tmp_path):
    """bf16: the bf16 parameter shard is offloaded, the separate fp32 master stays in memory; the step
    writes the shard back from the master (dirty), still bitwise the run without offload."""
    results = dist_run(2, param_offload_vs_plain, str(tmp_path), "adamw", 50, 2, True, True)
    for rank, r in enumerate(results):
        (plain_losses, plain_params, _), (losses, params, facts) = r["plain"], r["offloaded"]
        assert losses == plain_losses, f"rank {rank}: bf16 losses differ with offload_param"
        for name, value in plain_params.items():
            assert torch.equal(params[name], value), f"rank {rank}: {name} differs with offload_param (bf16)"
        assert facts["shards"] >= 3 and facts["folder_removed"]
        assert facts["grad_shards"] == 0  # bf16: the step converts whole gradient shards; they stay
    assert list(tmp_path.iterdir()) == []


def resume_across(ckpt_dir: str, nvme_dir: str, save_offload: bool) -> dict:
    with_param = make_config(nvme_dir, 60, 2, with_optimizer=True)
    without = make_config(nvme_dir, None, 2, with_optimizer=False)
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("adamw", model), with_param if save_offload else without)
    train_steps(engine, 3, MICRO_BS)
    engine.save_checkpoint(ckpt_dir)
    uninterrupted = train_steps(engine, 3, MICRO_BS, first_step=3)
    expected = engine.full_state_dict(rank0_only=False)
    engine.close()
    other = make_model(seed=5)
    resumed = zerodp.initialize(other, make_optimizer("adamw", other), without if save_offload else with_param)
    resumed.load_checkpoint(ckpt_dir)
    losses = train_steps(resumed, 3, MICRO_BS, first_step=3)
    got = resumed.full_state_dict(rank0_only=False)
    resumed.close()
    dist.barrier()
    return {"uninterrupted": uninterrupted, "resumed": losses,
            "same": all(torch.equal(got[k], v) for k, v in expected.items())}


@pytest.mark.parametrize("save_offload", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_resumes_across_param_offload_exactly(dist_run, tmp_path, world, save_offload):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = dist_run(world, resume_across, str(tmp_path / "ckpt"), str(nvme), save_offload)
    for rank, r in enumerate(results):
        assert r["resumed"] == r["uninterrupted"], f"rank {rank}: losses differ after resume"
        assert r["same"], f"rank {rank}: parameters differ after resume"
    assert list(nvme.iterdir()) == []


def built_offloaded(nvme_dir: str) -> dict:
    """zerodp.init_context with offload_param: each slice is written to its file as it is made."""
    cfg = make_config(nvme_dir, 40, 2, with_optimizer=True)
    with zerodp.init_context(cfg):
        model = make_model()
    from zerodp.shard.stage3.params import owner_of

    records = [owner_of(p) for p in model.parameters() if owner_of(p) is not None]
    home = records[0].ctx.param_home
    facts = {"slices": len(home.entries), "partitioned": len(records),
             "resident_numel": home.resident_numel, "max_in_cpu": home.max_in_cpu,
             "files": len(list(home.rank_dir.path.glob("param*.bin")))}
    engine = zerodp.initialize(model, make_optimizer("adamw", model), cfg)
    facts["init_files_removed"] = home.closed and not home.rank_dir.path.exists()
    losses = train_steps(engine, STEPS, MICRO_BS)
    params = engine.full_state_dict(rank0_only=False)
    engine.close()
    plain = run(make_config(nvme_dir, None, 2, False), "adamw")
    return {"facts": facts, "losses": losses, "params": params, "plain": plain}


@pytest.mark.parametrize("world", [2, 3])
def test_init_context_creates_shards_in_their_offloaded_home(dist_run, tmp_path, world):
    for rank, r in enumerate(dist_run(world, built_offloaded, str(tmp_path))):
        facts = r["facts"]
        assert facts["partitioned"] >= 4 and facts["slices"] == facts["partitioned"] == facts["files"]
        assert facts["resident_numel"] <= facts["max_in_cpu"], "slices beyond max_in_cpu stayed in memory"
        assert facts["init_files_removed"], "the init-time files outlive the hand-over to the engine"
        plain_losses, plain_params, _ = r["plain"]
        assert r["losses"] == plain_losses, f"rank {rank}: losses differ"
        for name, value in plain_params.items():
            assert torch.equal(r["params"][name], value), f"rank {rank}: {name} differs"
    assert list(tmp_path.iterdir()) == []


BIG_CLIP = 1e-3  # far below a fresh model's gradient norm: every step clips


def wide_unit_run(nvme_dir: str, max_in_cpu: int | None) -> dict:
    """Stage 3 fp32 with clipping, and a unit whose gradient shard spans two optimizer windows; with offload
    (max_in_cpu not None) its shard stays cached between them, or with max_in_cpu 0 is evicted to its file
    and read again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 600),
                                torch.nn.Tanh(), torch.nn.Linear(600, 4))
    zero = {"stage": 3, "sub_group_size": 1 << 18, "stage3_param_persistence_threshold": 0}
    if max_in_cpu is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 2}
        zero["offload_param"] = param_section(nvme_dir, max_in_cpu, 2)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": BIG_CLIP, "zero_optimization": zero}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, norms = [], []
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.grad_norm)
    grads = engine.sharding.grad_home
    facts = {"grad_offloaded": [u.grad_offloaded for u in engine.units],
             "grad_file_bytes": grads.disk_bytes() if grads is not None else 0,
             "grad_blocks": _blocks(grads) if grads is not None else 0,
             "widest_shard": max(u.grad_shard.numel() for u in engine.units),
             "chunk_numel": engine.optimizer.chunk_numel}
    params = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {"losses": losses, "norms": norms, "params": params, "facts": facts}


@pytest.mark.parametrize("max_in_cpu", [0, 10**9])
def test_clipping_an_offloaded_gradient_shard_that_spans_optimizer_windows(dist_run, tmp_path, max_in_cpu):
    """The step clips an offloaded gradient shard in place, chunk by chunk, in the window that steps each
    chunk: a shard spanning windows, whether it stays cached between them or is evicted and read back, is
    scaled exactly once (bitwise the run without offload, whose clipping scales every gradient once)."""
    results = dist_run(2, wide_unit_run, str(tmp_path), max_in_cpu)
    plain = dist_run(2, wide_unit_run, str(tmp_path), None)
    for rank, (r, p) in enumerate(zip(results, plain)):
        assert any(r["facts"]["grad_offloaded"]) and not any(p["facts"]["grad_offloaded"])
        assert r["facts"]["widest_shard"] > r["facts"]["chunk_numel"], "no gradient shard spans two windows"
        # between a step and the next backward the gradient files hold (almost) no disk: their blocks were
        # punched out when the shards were zeroed (offload/shard_store.py [Note: gradient shards offloaded])
        assert r["facts"]["grad_file_bytes"] > 1e6 and r["facts"]["grad_blocks"] * 512 < 0.01 * r["facts"]["grad_file_bytes"]
        assert min(p["norms"]) > 10 * BIG_CLIP, "clipping did not scale every step"
        assert r["losses"] == p["losses"], f"rank {rank}: losses differ with offloaded gradient shards"
        for name, value in p["params"].items():
            assert torch.equal(r["params"][name], value), f"rank {rank}: {name} differs with offload"
