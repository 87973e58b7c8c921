"""docs/performance.md ("Performance against the peers"): zerodp's losses are bitwise identical to DDP's at every stage.

torch's DistributedDataParallel and zerodp at stages 0-3 train the bundled tiny GPT (tied embedding,
layer norms) and the parity net (a frozen layer, an unused one) side by side on the same 2 gloo
ranks, from the same weights and batches, for 8 AdamW steps. At 2 ranks every reduction is a + b on
both sides (fp32 addition is commutative) and both divide the sum by the world size, so nothing may
differ: the losses and every parameter are compared with torch.equal, not a tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import zerodp
from tests.dist.common import make_model, micro_batch
from zerodp.tools.models.gpt import GPT, MODEL_PRESETS

STEPS, MICRO_BS = 8, 3


def _gpt():
    return GPT(MODEL_PRESETS["tiny"], seed=0)


def _gpt_batch(step: int, rank: int, world: int):
    vocab, seq = MODEL_PRESETS["tiny"].vocab_size, 16
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, vocab, (MICRO_BS * world, seq + 1), generator=g)[rank * MICRO_BS:(rank + 1) * MICRO_BS]
    return ids[:, :-1], ids[:, 1:]


def _loss(name: str, module, step: int, rank: int, world: int) -> torch.Tensor:
    if name == "gpt":
        x, y = _gpt_batch(step, rank, world)
        logits = module(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    x, y = micro_batch(step, 0, rank, world, MICRO_BS, 1)
    return F.mse_loss(module(x), y)


def _state(model) -> dict:
    with zerodp.gathered_parameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def ddp_vs_zerodp(name: str, stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    make = _gpt if name == "gpt" else make_model
    ref = make()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ddp = DistributedDataParallel(ref, find_unused_parameters=name != "gpt")
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)
    model = make()
    engine = zerodp.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                         lr=3e-3, weight_decay=0.1),
                               {"zero_optimization": {"stage": stage}})
    ref_losses, losses = [], []
    for step in range(STEPS):
        loss = _loss(name, ddp, step, rank, world)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
        loss = _loss(name, engine, step, rank, world)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    moved = max((p.detach() - init[n]).abs().max().item() for n, p in ref.named_parameters())
    result = {"losses": losses, "ref_losses": ref_losses, "params": _state(model), "moved": moved,
              "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()}}
    engine.close()
    return result


@pytest.mark.parametrize("name", ["gpt", "parity_net"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_is_bitwise_ddp(dist_run, stage, name):
    for rank, r in enumerate(dist_run(2, ddp_vs_zerodp, name, stage)):
        assert r["losses"] == r["ref_losses"], f"rank {rank}: losses differ from DDP's"
        assert r["moved"] > 1e-2, "DDP did not train: the comparison would be vacuous"
        for key, ref in r["ref_params"].items():
            assert torch.equal(r["params"][key], ref), \
                f"rank {rank} {key}: max diff {(r['params'][key] - ref).abs().max().item():.3e}"
