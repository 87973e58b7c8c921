"""DeepSpeed's `torch_autocast` section at stages 0-3 on 2 gloo ranks, bitwise against a plain-PyTorch
reference that does the same arithmetic in one process (zerodp/precision/autocast.py says what the section means).

The reference runs the parity model (fp32 parameters) under `torch.autocast("cpu", bfloat16)` on each
rank's micro-batches in turn and reduces as DeepSpeed does: the Linear layers' gradients (weights and
biases) are cast to bf16, summed over the two ranks in bf16 and halved in bf16, then cast back; the
other gradients (the `gain` vector) are summed and halved in fp32. Stages 0-1 reduce the fp32
gradient accumulated over the micro-steps at the boundary, stages 2-3 reduce every micro-step and add
the fp32 results. AdamW then steps the fp32 parameters.

Why bitwise (torch.equal): each rank's forward and backward are the reference's ops on the same
values (one thread, same shapes), a sum of two values is the same in either order, and the casts and
divisions are the same operations in the same order. The test also checks that the section changes
the result against autocast with fp32 reductions (so bf16 reductions that were silently fp32 would
fail), and that the stage-3 units which hold both kinds of parameters reduce in two dtypes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import make_model, make_optimizer, micro_batch, train_steps

STEPS, MICRO_BS, GAS, WORLD = 3, 2, 2, 2
AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


def config(stage: int, autocast: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": GAS,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}, **autocast}


def zerodp_case(stage: int, autocast: dict) -> dict:
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config(stage, autocast))
    x, _ = micro_batch(0, 0, 0, WORLD, MICRO_BS, GAS)
    out_dtype = str(engine(x).dtype)  # a forward outside training: autocast applies there too
    result = {"comm_dtypes": sorted({str(u.grads.comm_dtype) for u in engine.units}),
              "split_units": sum(u.grads.split is not None for u in engine.units), "out_dtype": out_dtype}
    result["losses"] = train_steps(engine, STEPS, MICRO_BS)
    with zerodp.gathered_parameters(model.parameters()):
        result["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.close()
    return result


def _average(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The two ranks' gradients summed and halved in `dtype`, as the collective and its division do."""
    return ((grads[0].to(dtype) + grads[1].to(dtype)) / WORLD).float()


def reference(stage: int, low_precision: bool) -> tuple[list[float], dict]:
    """Plain PyTorch, one process (module docstring); `low_precision` False: every reduction in fp32."""
    model = make_model()
    opt = make_optimizer("adamw", model)
    linear = {id(p) for m in model.modules() if type(m) is torch.nn.Linear for p in m.parameters(recurse=False)}
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = [torch.bfloat16 if low_precision and id(p) in linear else torch.float32 for p in params]
    losses = []
    for step in range(STEPS):
        full = [[torch.zeros_like(p) for p in params] for _ in range(WORLD)]  # stages 0-1
        reduced = [torch.zeros_like(p) for p in params]                       # stages 2-3
        got = [False] * len(params)
        totals = [torch.zeros(1) for _ in range(WORLD)]  # per rank, then summed: train_steps' order
        for micro in range(GAS):
            grads = []
            for rank in range(WORLD):
                x, y = micro_batch(step, micro, rank, WORLD, MICRO_BS, GAS)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                loss = F.mse_loss(out.float(), y)
                totals[rank] += loss.detach()
                grads.append(torch.autograd.grad(loss * (1.0 / GAS), params, allow_unused=True))
            for i in range(len(params)):
                if grads[0][i] is None:
                    continue
                got[i] = True
                if stage >= 2:
                    reduced[i].add_(_average([g[i] for g in grads], dtypes[i]))
                else:
                    for rank in range(WORLD):
                        full[rank][i].add_(grads[rank][i])
        for i, p in enumerate(params):
            if stage < 2 and got[i]:
                reduced[i] = _average([full[rank][i] for rank in range(WORLD)], dtypes[i])
            p.grad = reduced[i] if got[i] else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((totals[0] + totals[1]).item() / (WORLD * GAS))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_autocast_is_deepspeeds_arithmetic(dist_run, stage):
    ref_losses, ref_params = reference(stage, low_precision=True)
    fp32_losses, fp32_params = reference(stage, low_precision=False)
    assert any(not torch.equal(ref_params[k], fp32_params[k]) for k in ref_params), "bf16 reductions change nothing"
    for rank, r in enumerate(dist_run(WORLD, zerodp_case, stage, AUTOCAST)):
        assert r["out_dtype"] == "torch.bfloat16", f"rank {rank}: the forward did not autocast ({r['out_dtype']})"
        assert r["comm_dtypes"] == ["torch.bfloat16", "torch.float32"], f"rank {rank}: {r['comm_dtypes']}"
        if stage == 3:  # the parity model's root unit holds Linear biases and the `gain` vector together
            assert r["split_units"] > 0, f"rank {rank}: no stage-3 unit reduced in two dtypes"
        else:           # stage 0-2 buckets are split by reduction dtype
            assert r["split_units"] == 0, f"rank {rank}: a bucket mixes reduction dtypes"
        assert r["losses"] == ref_losses, f"rank {rank}: losses {r['losses']} != reference {ref_losses}"
        for key, ref in ref_params.items():
            assert torch.equal(r["params"][key], ref), \
                f"rank {rank} {key}: max diff {(r['params'][key] - ref).abs().max().item():.3e}"


def test_no_safe_modules_reduces_everything_in_fp32(dist_run):
    """An empty `lower_precision_safe_modules` autocasts the forward and reduces every gradient in fp32."""
    ref_losses, ref_params = reference(2, low_precision=False)
    section = {"torch_autocast": {"enabled": True, "lower_precision_safe_modules": []}}
    for rank, r in enumerate(dist_run(WORLD, zerodp_case, 2, section)):
        assert r["out_dtype"] == "torch.bfloat16" and r["comm_dtypes"] == ["torch.float32"], f"rank {rank}"
        assert r["losses"] == ref_losses, f"rank {rank}"
        for key, ref in ref_params.items():
            assert torch.equal(r["params"][key], ref), f"rank {rank} {key}"
