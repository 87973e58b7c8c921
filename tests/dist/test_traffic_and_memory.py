"""What each stage moves and holds, against the ZeRO paper: 2Ψ of traffic per step for stages 0-2
(all-reduce = reduce-scatter + all-gather), gradients kept at 1/N by stage 2, and model-state bytes
per rank equal to the formula (params, grads, optimizer) within 1% plus padding."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from zerodp import comm
from zerodp.shard.grads.reduce_queue import MAX_INFLIGHT
from tests.dist.common import make_model, make_optimizer, micro_batch


def one_step(stage: int, precision: str = "fp32", bucket: int = 300, keys: dict | None = None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                 # stage 3: shard every parameter (none kept whole), one unit per Linear
                                 "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(keys or {})
    engine = zerodp.initialize(model, make_optimizer("adamw", model), cfg)
    x, y = micro_batch(0, 0, rank, world, 4, 1)
    with comm.record() as log:
        engine.backward(F.mse_loss(engine(x).float(), y))
        grad_bytes_after_backward = sum(u.grad_bytes() for u in engine.units)
        engine.step()
    padded = sum(u.layout.padded_numel for u in engine.units)
    frozen_numel = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return {
        "frozen_numel": frozen_numel,
        "psi": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "padded": padded,
        "elem": 2 if precision == "bf16" else 4,
        "grad_numel": log.numel("all_reduce", "grad") + log.numel("reduce_scatter", "grad"),
        "grad_ops": sorted({r.op for r in log.records if r.tag == "grad"}),
        "grad_bytes_moved": sum(r.nbytes for r in log.records if r.tag == "grad"),
        "param_numel": log.numel("all_gather", "param"),
        "control_numel": sum(r.numel for r in log.records if r.tag in ("control", "norm")),
        "grad_bytes_after_backward": grad_bytes_after_backward,
        "report": engine.memory_report().as_dict(),
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_traffic_per_step_is_two_psi(dist_run, world, stage):
    for r in dist_run(world, one_step, stage):
        psi, padded = r["psi"], r["padded"]
        assert padded - psi < world * 8, "padding stays below N elements per bucket"
        assert r["grad_numel"] == padded, "every gradient element is reduced exactly once"
        if stage == 0:
            assert r["grad_ops"] == ["all_reduce"] and r["param_numel"] == 0  # all-reduce = RS + AG = 2Ψ
        else:
            assert r["grad_ops"] == ["reduce_scatter"]
            assert r["param_numel"] == padded  # Ψ reduce-scatter + Ψ all-gather = 2Ψ, as the paper says
        # bookkeeping (overflow/late-gradient flags, norm) is a few scalars per parameter, not per element
        assert r["control_numel"] < 0.2 * psi


@pytest.mark.parametrize("world", [2, 3])
def test_stage2_keeps_one_nth_of_gradients(dist_run, world):
    for r in dist_run(world, one_step, 2):
        shard_bytes = r["padded"] // world * r["elem"]
        assert r["grad_bytes_after_backward"] == shard_bytes
        assert r["report"]["grads_bytes"] == shard_bytes


def full_buffers_in_backward(stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(8)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    # one bucket per layer (272 elements), so backward completes eight buckets one after another
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               {"zero_optimization": {"stage": stage, "reduce_bucket_size": 300}})
    alive = []  # full gradient buffers allocated, after every gradient (zerodp's hooks ran first)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(u.grads.full.nbytes > 0 for u in engine.units)))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).square().mean())
    engine.step()
    return {"alive": alive, "buckets": len(engine.units), "world": world}


@pytest.mark.parametrize("world", [2])
def test_stage2_full_gradient_buffers_are_bounded_in_backward(dist_run, world):
    """Stage 2 frees each bucket's full gradient once its reduction is waited on; reductions in flight
    are bounded, so at most MAX_INFLIGHT buckets being reduced plus the one filling exist at once
    (unbounded, every bucket's full buffer lived to the end of backward)."""
    for r in dist_run(world, full_buffers_in_backward, 2):
        assert r["buckets"] >= MAX_INFLIGHT + 4
        assert max(r["alive"]) <= MAX_INFLIGHT + 1, f"full buffers alive during backward: {r['alive']}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_memory_report_matches_formula(dist_run, world, stage, precision):
    for r in dist_run(world, one_step, stage, precision):
        rep = r["report"]
        pad = rep["padding_numel"]
        k = (4 if precision == "bf16" else 0) + 8  # fp32 master if separate + Adam's two moments
        for kind, per_elem in (("params", r["elem"]), ("grads", r["elem"]), ("optimizer", k)):
            measured, predicted = rep[f"{kind}_bytes"], rep[f"{kind}_bytes_predicted"]
            assert abs(measured - predicted) <= 0.01 * predicted + pad * per_elem, (kind, measured, predicted)
        # the prediction is the paper's: stage 1 4Ψ+KΨ/N, stage 2 2Ψ+(2+K)Ψ/N with mixed precision
        psi, n, e = rep["numel"], world, r["elem"]
        expected = {0: e * psi + e * psi + k * psi, 1: 2 * e * psi + k * psi / n,
                    2: e * psi + (e + k) * psi / n}[stage]
        total = sum(rep[f"{kind}_bytes_predicted"] for kind in ("params", "grads", "optimizer"))
        assert total == pytest.approx(expected)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_fp32_gradient_accumulation_costs_four_bytes_per_gradient(dist_run, world, stage):
    """bf16 with data_types.grad_accum_dtype fp32: the persistent gradients (stage 1: the full buffer; stage 2:
    the shard) are fp32, and memory_report predicts them with 4 bytes per element."""
    keys = {"data_types": {"grad_accum_dtype": "fp32"}}
    for r in dist_run(world, one_step, stage, "bf16", 300, keys):
        rep = r["report"]
        expected = r["padded"] * 4 // (world if stage == 2 else 1)
        assert r["grad_bytes_after_backward"] == rep["grads_bytes"] == expected
        assert abs(rep["grads_bytes_predicted"] - expected) <= rep["padding_numel"] * 4


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_communication_moves_four_bytes_per_gradient(dist_run, stage):
    """bf16 with communication_data_type fp32: the same gradient elements are reduced, at twice the bytes."""
    bf16 = dist_run(2, one_step, stage, "bf16")
    fp32 = dist_run(2, one_step, stage, "bf16", 300, {"communication_data_type": "fp32"})
    for a, b in zip(bf16, fp32):
        assert a["grad_numel"] == b["grad_numel"] > 0
        assert b["grad_bytes_moved"] == 2 * a["grad_bytes_moved"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [3])
def test_frozen_parameters_cost_no_gradient_or_optimizer_memory(dist_run, world, stage):
    for r in dist_run(world, one_step, stage):
        rep = r["report"]
        assert r["frozen_numel"] > 0 and rep["numel"] == r["psi"]  # Ψ counts trainable elements only
        expected = r["frozen_numel"] * r["elem"]
        if stage == 3:  # sharded like every other parameter: 1/N of it, up to padding
            assert expected / world <= rep["frozen_param_bytes"] <= expected / world + world * r["elem"] * 2
        else:
            assert rep["frozen_param_bytes"] == expected
