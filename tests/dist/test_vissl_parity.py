"""A SwAV-like ResNet trained from VISSL's own SwAV config file (tests/configs/vissl) at stage 2
(MODEL.SHARDED_DDP_SETUP.USE_SDP) and stage 3 (MODEL.FSDP_CONFIG) matches plain PyTorch with the same
LARC-SGD, param groups and warmup + cosine schedule, written out here from VISSL's documentation.

Without SyncBN, BatchNorm normalizes each replica's batch; the reference therefore runs the same
per-rank chunks through one model and averages their losses (the gradient data parallelism computes).
"""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
import zerodp.adapters.vissl.vissl_engine
from tests.oracle import train_reference
from zerodp.config.vissl import load_vissl

SWAV = Path(__file__).resolve().parents[1] / "configs" / "vissl" / "swav_8node_resnet.yaml"
STEPS_PER_EPOCH, MICRO_BS = 6, 3
# hydra command-line overrides a VISSL user would pass: one short epoch, fp32 so that parity is exact
COMMON = ["config.OPTIMIZER.num_epochs=1", "config.MODEL.AMP_PARAMS.USE_AMP=False"]
OVERRIDES = {2: COMMON + ["config.MODEL.SHARDED_DDP_SETUP.USE_SDP=True",
                          "config.MODEL.SHARDED_DDP_SETUP.reduce_buffer_size=200"],
             3: COMMON + ["config.MODEL.FSDP_CONFIG.AUTO_WRAP_THRESHOLD=300",
                          "config.MODEL.FSDP_CONFIG.compute_dtype=float32"]}


class Block(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)
        self.conv2, self.bn2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinySwAV(nn.Module):
    """ResNet stem + 2 residual blocks, SwAV head (MLP with BN, L2-normalized, prototypes without bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.blocks = nn.Sequential(Block(6), Block(6))
        # no bias before a BatchNorm: BN cancels it, so its true gradient is 0 and LARC would turn float
        # noise there (~1e-10) into an lr-sized step whose sign depends on summation order
        self.head = nn.Sequential(nn.Linear(6, 10, bias=False), nn.BatchNorm1d(10), nn.ReLU(), nn.Linear(10, 7))
        self.prototypes = nn.Linear(7, 5, bias=False)

    def forward(self, x):
        h = self.blocks(self.stem(x)).mean(dim=(2, 3))
        return self.prototypes(F.normalize(self.head(h), dim=1))


def swapped_loss(model, x):
    """SwAV's swapped prediction on two noisy views (sharpened softmax codes stand in for Sinkhorn)."""
    g = torch.Generator().manual_seed(int(x.sum().item() * 1000) % 10_000)
    views = [x + 0.1 * torch.randn(x.shape, generator=g) for _ in range(2)]
    scores = [model(v) for v in views]
    codes = [F.softmax(s.detach() / 0.05, dim=1) for s in scores]
    return -0.5 * sum((codes[1 - i] * F.log_softmax(scores[i] / 0.1, dim=1)).sum(1).mean() for i in range(2))


def images(step: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, 3, 5, 5, generator=torch.Generator().manual_seed(500 + step))


def make_model() -> TinySwAV:
    torch.manual_seed(0)
    return TinySwAV()


def swav_lr(step: int) -> float:
    """VISSL's SwAV schedule at 64 x 8 x 8 = 4096: linear 0.6 -> 4.8 over 2.5% of training (rescaled),
    then cosine 4.8 -> 0.0048 evaluated at the global fraction (fixed)."""
    where = step / STEPS_PER_EPOCH  # one epoch
    if where + 1e-6 <= 0.025:
        return 0.6 + (where / 0.025) * (4.8 - 0.6)
    return 0.0048 + 0.5 * (4.8 - 0.0048) * (1 + math.cos(math.pi * where))


def reference(world: int) -> tuple[list[float], list[float], dict]:
    model = make_model()
    # SwAV's file: regularize_bn and regularize_bias True -> one decayed group, LARC (clip False, 1e-3)
    opt = zerodp.optim.LARC(torch.optim.SGD(model.parameters(), lr=0.6, momentum=0.9, weight_decay=1e-6),
                            trust_coefficient=0.001, clip=False, eps=1e-8)
    lrs = []

    def schedule(model, optimizer, step: int) -> None:
        for g in optimizer.param_groups:
            g["lr"] = swav_lr(step)
        lrs.append(optimizer.param_groups[0]["lr"])

    def step_loss(model, step: int) -> torch.Tensor:
        x = images(step, MICRO_BS * world)
        return sum(swapped_loss(model, x[r * MICRO_BS:(r + 1) * MICRO_BS]) for r in range(world)) / world

    ref = train_reference(model, opt, STEPS_PER_EPOCH, step_loss, before_step=schedule, named_parameters_only=True)
    return ref.losses, lrs, ref.params


def vissl_run(stage: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    setup = load_vissl(SWAV, overrides=OVERRIDES[stage])
    model = make_model()
    engine, schedule = zerodp.adapters.vissl.vissl_engine.initialize(setup, model, steps_per_epoch=STEPS_PER_EPOCH)
    assert engine.stage == stage and isinstance(engine.optimizer.optimizer, zerodp.optim.LARC)
    losses, lrs = [], []
    for step in range(STEPS_PER_EPOCH):
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        x = images(step, MICRO_BS * world)[rank * MICRO_BS:(rank + 1) * MICRO_BS]
        loss = swapped_loss(engine, x)
        engine.backward(loss)
        engine.step()
        schedule.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with zerodp.gathered_parameters(model.parameters()):
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return losses, lrs, params, engine.config.zero_optimization.model_dump()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_swav_file_trains_like_pytorch(dist_run, world, stage):
    ref_losses, ref_lrs, ref_params = reference(world)
    assert ref_lrs[0] == pytest.approx(0.6) and ref_lrs[1] < 4.8  # warmup step, then the cosine
    for rank, (losses, lrs, params, zero) in enumerate(dist_run(world, vissl_run, stage, timeout=180)):
        assert lrs == pytest.approx(ref_lrs, rel=1e-12)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        if stage == 2:
            assert zero["reduce_bucket_size"] == 200
        else:
            assert zero["stage3_unit_min_params"] == 300 and zero["stage3_param_persistence_threshold"] == 0
    init = dict(make_model().named_parameters())
    assert max((ref_params[k] - init[k]).abs().max().item() for k in init) > 1e-3  # training moved the weights
