"""`deepspeed.initialize(model=m, config=c)` without an optimizer at ZeRO stage 3 (DeepSpeed-Chat DPO's
reference model): the forward-only engine keeps the parameters sharded (stage 3's strategy, every unit
frozen), and its forwards equal the plain module's in the same dtype, bitwise: a gathered parameter is the
same bf16 values, and the forward runs the same operations on them. Built whole (broadcast from rank 0) and
built under `zero.Init` (as HfDeepSpeedConfig makes transformers do), on 2 and 3 gloo ranks (3: padding).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp.deepspeed as deepspeed
from zerodp.deepspeed.forward_engine import ForwardEngine
from zerodp.shard.stage3 import PartitionedParameter

# the biases (16 elements) stay whole; the weights (>= 64 elements) are sharded
CONFIG = {"train_batch_size": 4, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 32}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(rank)).bfloat16()


def forward_only(built_sharded: bool) -> dict:
    rank = torch.distributed.get_rank()
    if built_sharded:
        with deepspeed.zero.Init(config_dict_or_path=CONFIG):
            model = _model()
    else:
        torch.manual_seed(rank)
        model = _model()
        if rank != 0:  # other weights than rank 0's: the engine starts from rank 0's, as DeepSpeed's
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
    engine, optimizer, loader, schedule = deepspeed.initialize(model=model, config=CONFIG)
    assert isinstance(engine, ForwardEngine) and (optimizer, loader, schedule) == (None, None, None)
    x = _inputs(rank)
    out = {"train": engine(x)}  # train mode: every unit released after its forward
    sharded = [n for n, p in model.named_parameters() if isinstance(p, PartitionedParameter)]
    out["live_after_train_forward"] = engine.sharding.live_numel
    engine.eval()
    with torch.no_grad():
        out["eval"] = [engine(x), engine(x)]  # the second may find units kept by the inference cache
    engine.train()
    out["live_after_train"] = engine.sharding.live_numel
    out["sharded"] = sharded
    out["dtypes"] = {n: p.dtype for n, p in model.named_parameters()}
    out["units"] = [(sum(p.numel() for p in f.params), f.param_shard.numel()) for f in engine.sharding.frozen_units]
    out["trainable_units"] = len(engine.sharding.units)
    out["grads"] = [n for n, p in model.named_parameters() if p.grad is not None]
    out["requires_grad"] = out["train"].requires_grad
    for call in (lambda: engine.backward(out["train"].float().sum()), engine.step):
        try:
            call()
            out.setdefault("refused", []).append(None)
        except RuntimeError as e:
            out.setdefault("refused", []).append(str(e))
    engine.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("built_sharded", [False, True], ids=["built-whole", "zero-init"])
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_forward_only_engine_equals_plain_forward_and_stays_sharded(dist_run, world, built_sharded):
    plain = _model().bfloat16()  # rank 0's weights in the compute dtype; the inputs are not cast (bf16 given)
    with torch.no_grad():
        wants = [plain(_inputs(rank)) for rank in range(world)]
    for rank, r in enumerate(dist_run(world, forward_only, built_sharded)):
        want = wants[rank]
        assert r["train"].dtype == torch.bfloat16 and torch.equal(r["train"], want), (r["train"] - want).abs().max()
        assert all(torch.equal(got, want) for got in r["eval"])
        assert r["sharded"] == ["0.weight", "2.0.weight", "3.weight"], r["sharded"]  # biases under the threshold
        assert set(r["dtypes"].values()) == {torch.bfloat16}
        assert r["live_after_train_forward"] == 0 and r["live_after_train"] == 0
        # each rank holds 1/world of the sharded weights (padded), in frozen units: no gradient, no optimizer state
        assert sum(numel for numel, _ in r["units"]) == 8 * 16 + 16 * 16 + 16 * 4, r["units"]
        assert all(shard == -(-numel // world) for numel, shard in r["units"]), r["units"]
        assert r["trainable_units"] == 0 and r["grads"] == [] and not r["requires_grad"]
        assert r["refused"][0] is not None and "without an optimizer" in r["refused"][0]
        assert r["refused"][1] is not None and "without an optimizer" in r["refused"][1]
