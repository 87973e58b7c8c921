"""DeepSpeed's gradient arithmetic keys (`communication_data_type`, `data_types.grad_accum_dtype`,
`gradient_predivide_factor`, `prescale_gradients`) at stages 0-3 on 2 gloo ranks, in bf16, fp16 (static
loss scale) and fp32 runs, bitwise against a
plain-PyTorch reference that does the same arithmetic in one process.

The reference (`simulated_reference`) runs the parity model in bf16 (or fp32) on each rank's
micro-batches in turn and writes out what the keys mean (grads/grad_arithmetic.py's docstring): each
micro-step's 16-bit gradient is accumulated in grad_accum_dtype, cast to communication_data_type,
divided by the pre-divisor, summed over the two ranks, divided by the post-divisor and cast back;
stages 0-1 reduce the accumulated gradient at the boundary, stages 2-3 reduce every micro-step and
accumulate the reduced result. The fp32 master copies are then stepped by the same torch optimizer.

Why bitwise (torch.equal, no tolerance): every rank's forward and backward are the reference's own
ops on the same values (one thread, same shapes), a sum of two values is the same in either order,
and the casts and divisions are the same operations in the same order. Any difference is a different
arithmetic. Each case also checks that its arithmetic changes the result against the default one
(so a key that were silently ignored would fail), except where it cannot at 2 ranks (`SAME_AT_2_RANKS`):
- prescale: N = 2 is a power of two, so dividing before or after the sum is the same value;
- fp32 reduction of bf16 gradients accumulated in bf16: the fp32 sum of two bf16 values is exact, so
  casting it back rounds once, as the bf16 sum does (and halving commutes with rounding).
There the wiring is checked instead (the engine's divisors and reduction dtype), and the arithmetic at
3 ranks by tests/unit/shard/test_grad_arithmetic.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from tests.dist.common import _Params, make_model, make_optimizer, micro_batch, train_steps

STEPS, MICRO_BS, GAS, WORLD = 4, 2, 3, 2
LOSS_SCALE = 256.0  # fp16 runs
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config(stage: int, compute: str, keys: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": GAS,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}, **keys}
    if compute == "bf16":
        cfg["bf16"] = {"enabled": True}
    if compute == "fp16":  # static, so that the reference scales by the same number
        cfg["fp16"] = {"enabled": True, "loss_scale": LOSS_SCALE}
    return cfg


def zerodp_case(stage: int, compute: str, keys: dict, opt_name: str) -> dict:
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer(opt_name, model), config(stage, compute, keys))
    arithmetic = engine.units[0].grads.arithmetic
    comm_dtypes = {str(u.grads.comm_dtype) for u in engine.units}
    shard_dtypes = {str(u.grad_shard.dtype) for u in engine.units}
    losses = train_steps(engine, STEPS, MICRO_BS)
    with zerodp.gathered_parameters(model.parameters()):
        params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    engine.close()
    return {"losses": losses, "params": params, "pre": arithmetic.pre_divisor, "post": arithmetic.post_divisor,
            "shard_dtypes": shard_dtypes, "comm_dtypes": comm_dtypes}


def _reduce(sends: list[torch.Tensor], pre: float, post: float, accum: torch.dtype) -> torch.Tensor:
    """The collective as the reference writes it: divide, sum the ranks, divide, cast back."""
    sends = [s / pre if pre != 1.0 else s for s in sends]
    total = sends[0] + sends[1]
    return (total / post if post != 1.0 else total).to(accum)


def simulated_reference(stage: int, compute: str, keys: dict, opt_name: str) -> tuple[list[float], dict]:
    """Plain PyTorch in one process: the two ranks' gradients computed in turn, then reduced as `keys` say."""
    dtype = DTYPES[compute]
    accum = DTYPES.get(keys.get("data_types", {}).get("grad_accum_dtype"), dtype)
    comm = DTYPES.get(keys.get("communication_data_type"), dtype)
    p = keys.get("gradient_predivide_factor", 1.0)
    pre, post = (WORLD, 1.0) if keys.get("prescale_gradients") else (p, WORLD / p)
    scale = LOSS_SCALE if compute == "fp16" else 1.0  # the engine scales the loss by scale / GAS
    model = make_model().to(dtype)
    params = [q for q in model.parameters() if q.requires_grad]
    masters = [q.detach().float().clone().requires_grad_(q.requires_grad) for q in model.parameters()]
    opt = make_optimizer(opt_name, _Params(masters))
    trained = [m for m in masters if m.requires_grad]
    losses = []
    for step in range(STEPS):
        full = [[torch.zeros_like(q, dtype=accum) for q in params] for _ in range(WORLD)]  # stages 0-1
        shard = [torch.zeros_like(q, dtype=accum) for q in params]                          # stages 2-3
        got = [False] * len(params)
        totals = [torch.zeros(1) for _ in range(WORLD)]
        for micro in range(GAS):
            grads = []
            for rank in range(WORLD):
                x, y = micro_batch(step, micro, rank, WORLD, MICRO_BS, GAS)
                loss = F.mse_loss(model(x.to(dtype)).float(), y)
                totals[rank] += loss.detach().float()
                grads.append(torch.autograd.grad(loss * (scale / GAS), params, allow_unused=True))
            for i, q in enumerate(params):
                if grads[0][i] is None:
                    continue
                got[i] = True
                if stage >= 2:  # reduce this micro-step, accumulate the rank average
                    shard[i].add_(_reduce([g[i].to(comm) for g in grads], pre, post, accum))
                else:           # accumulate each rank's gradient
                    for rank in range(WORLD):
                        full[rank][i].add_(grads[rank][i])
        for i in range(len(params)):
            if stage < 2 and got[i]:
                shard[i] = _reduce([full[rank][i].to(comm) for rank in range(WORLD)], pre, post, accum)
            grad = shard[i].float()
            trained[i].grad = (grad / scale if scale != 1.0 else grad) if got[i] else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for q, m in zip(model.parameters(), masters):
                q.copy_(m)
        losses.append((totals[0] + totals[1]).item() / (WORLD * GAS))
    return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _differs(a: tuple[list[float], dict], b: tuple[list[float], dict]) -> bool:
    return any(not torch.equal(a[1][k], b[1][k]) for k in a[1])


CASES = {
    # name: (compute dtype, keys, stages)
    "fp32_reduce": ("bf16", {"communication_data_type": "fp32"}, [0, 1, 2, 3]),
    "fp32_accum": ("bf16", {"data_types": {"grad_accum_dtype": "fp32"}}, [1, 2, 3]),
    "fp32_reduce_and_accum": ("bf16", {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}},
                              [1, 2, 3]),
    "bf16_reduce_of_fp32": ("fp32", {"communication_data_type": "bf16"}, [1, 2]),
    "predivide_3": ("bf16", {"gradient_predivide_factor": 3.0}, [0, 1, 2, 3]),
    "fp32_reduce_predivide_3": ("bf16", {"communication_data_type": "fp32", "gradient_predivide_factor": 3.0},
                                [1, 3]),
    "prescale": ("bf16", {"prescale_gradients": True}, [0, 2, 3]),
    "fp16_fp32_accum": ("fp16", {"data_types": {"grad_accum_dtype": "fp32"}}, [1, 2, 3]),
    "fp16_predivide_3": ("fp16", {"gradient_predivide_factor": 3.0}, [1, 3]),
}
SAME_AT_2_RANKS = {"prescale", "fp32_reduce"}  # see the module docstring
PARAMS = [(name, stage) for name, (_, _, stages) in CASES.items() for stage in stages]


@pytest.mark.parametrize("name,stage", PARAMS, ids=[f"{n}-stage{s}" for n, s in PARAMS])
def test_gradient_arithmetic_is_exact(dist_run, name, stage):
    compute, keys, _ = CASES[name]
    opt_name = "sgd"
    ref_losses, ref_params = simulated_reference(stage, compute, keys, opt_name)
    default = simulated_reference(stage, compute, {}, opt_name)
    if name in SAME_AT_2_RANKS:
        assert not _differs((ref_losses, ref_params), default)  # see the module docstring
    else:
        assert _differs((ref_losses, ref_params), default), f"{name}: the keys change nothing; the test is vacuous"
    accum = keys.get("data_types", {}).get("grad_accum_dtype", compute)
    comm = keys.get("communication_data_type", compute)
    for rank, r in enumerate(dist_run(WORLD, zerodp_case, stage, compute, keys, opt_name)):
        assert r["shard_dtypes"] == {str(DTYPES[accum])}, f"rank {rank}: gradient shards in {r['shard_dtypes']}"
        assert r["comm_dtypes"] == {str(DTYPES[comm])}, f"rank {rank}: reductions in {r['comm_dtypes']}"
        if name == "prescale":
            assert (r["pre"], r["post"]) == (WORLD, 1.0), "prescale_gradients must divide before the sum"
        assert r["losses"] == ref_losses, f"rank {rank}: losses {r['losses']} != reference {ref_losses}"
        for key, ref in ref_params.items():
            assert torch.equal(r["params"][key], ref), \
                f"rank {rank} {key}: max diff {(r['params'][key] - ref).abs().max().item():.3e}"


def adam_case(stage: int) -> dict:
    return zerodp_case(stage, "bf16", CASES["fp32_reduce_and_accum"][1], "adamw")


@pytest.mark.parametrize("stage", [1, 3])
def test_fp32_reduce_and_accum_with_adamw(dist_run, stage):
    """The same exactness with AdamW (elementwise, as SGD, but its update reads every bit of the gradient)."""
    keys = CASES["fp32_reduce_and_accum"][1]
    ref_losses, ref_params = simulated_reference(stage, "bf16", keys, "adamw")
    for rank, r in enumerate(dist_run(WORLD, adam_case, stage)):
        assert r["losses"] == ref_losses, f"rank {rank}"
        for key, ref in ref_params.items():
            assert torch.equal(r["params"][key], ref), f"rank {rank} {key}"
