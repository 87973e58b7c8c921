"""`zerodp.optim.LARC` equals LARC as the paper and NVIDIA apex define it, written here independently.

You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017), and apex's
`apex.parallel.LARC` (the implementation VISSL wraps): for each parameter w with gradient g in a
group with learning rate lr and weight decay wd,
    local_lr = trust * ||w|| / (||g|| + wd * ||w|| + eps)      (left at 1 where ||w|| or ||g|| is 0)
    clipping mode: local_lr = min(local_lr / lr, 1)
    g <- (g + wd * w) * local_lr
then the wrapped SGD steps with its own weight decay switched off. Norms are of the *whole* tensor,
which is what sharding makes hard: zerodp shards the flat parameters at stages 1-3, so this runs
at stages 2 and 3 on 2 and 3 gloo ranks and compares with a one-process run of the formula above.
Tolerance: fp32 summation order (rtol 1e-5, atol 1e-6 at weights of order 0.1-1); a local_lr
computed from a shard's norm instead of the whole tensor's is off by tens of percent and fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from tests.dist.common import assert_matches_reference, make_model, micro_batch, param_groups

STEPS, MICRO_BS, TRUST, LR, WD = 4, 3, 0.02, 0.1, 1e-3


def larc_by_the_formula(world: int, clip: bool) -> tuple[list[float], dict]:
    model = make_model()
    sgd = torch.optim.SGD(param_groups(model, WD), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        rows = [micro_batch(step, 0, r, world, MICRO_BS, 1) for r in range(world)]
        loss = F.mse_loss(model(torch.cat([r[0] for r in rows])), torch.cat([r[1] for r in rows]))
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            saved_wd = []
            for group in sgd.param_groups:
                wd, lr = group["weight_decay"], group["lr"]
                saved_wd.append(wd)
                group["weight_decay"] = 0.0
                for w in group["params"]:
                    if w.grad is None:
                        continue
                    w_norm, g_norm = w.norm(), w.grad.norm()
                    if w_norm == 0 or g_norm == 0:
                        continue
                    local_lr = TRUST * w_norm / (g_norm + wd * w_norm + 1e-8)
                    if clip:
                        local_lr = torch.clamp(local_lr / lr, max=1.0)
                    w.grad.add_(w, alpha=wd).mul_(local_lr)
            sgd.step()
            for group, wd in zip(sgd.param_groups, saved_wd):
                group["weight_decay"] = wd
        sgd.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def zerodp_larc(stage: int, clip: bool) -> tuple[list[float], dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    larc = zerodp.optim.LARC(torch.optim.SGD(param_groups(model, WD), lr=LR, momentum=0.9),
                             trust_coefficient=TRUST, clip=clip)
    engine = zerodp.initialize(model, larc, {"zero_optimization": {"stage": stage}})
    losses = []
    for step in range(STEPS):
        x, y = micro_batch(step, 0, rank, world, MICRO_BS, 1)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with zerodp.gathered_parameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return losses, params


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("stage,world", [(2, 2), (3, 3)])
def test_larc_equals_the_papers_formula(dist_run, stage, world, clip):
    ref_losses, ref_params = larc_by_the_formula(world, clip)
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    assert max((ref_params[k] - init[k]).abs().max().item() for k in init) > 1e-3, "the formula run did not train"
    for rank, (losses, params) in enumerate(dist_run(world, zerodp_larc, stage, clip)):
        assert_matches_reference(rank, losses, params, ref_losses, ref_params, what=f"LARC clip={clip}")
