"""The configuration alone selects the optimizer and the stage: DeepSpeed's `optimizer` section and
VISSL's YAML (SGD + LARC, USE_SDP) give exactly the run an explicitly built optimizer gives."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
import zerodp.adapters.vissl.vissl_engine
from zerodp.config.vissl import load_vissl
from tests.dist.common import make_model, micro_batch
from tests.unit.config.test_config import VISSL_YAML


def train(engine, model, steps=4) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        x, y = micro_batch(step, 0, rank, world, 3, 1)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


def config_section_vs_explicit(yaml_path: str) -> bool:
    import yaml

    # DeepSpeed's optimizer section, stage 1
    a = make_model()
    ea = zerodp.initialize(a, None, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                                     "zero_optimization": {"stage": 1}})
    b = make_model()
    eb = zerodp.initialize(b, torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1),
                           {"zero_optimization": {"stage": 1}})
    same_ds = all(torch.equal(p, q) for p, q in zip(train(ea, a), train(eb, b)))
    # VISSL: OPTIMIZER.name zero + LARC + USE_SDP (stage 2)
    c = make_model()
    ec, _ = zerodp.adapters.vissl.vissl_engine.initialize(load_vissl(yaml_path), c, steps_per_epoch=1)
    assert ec.stage == 2 and isinstance(ec.optimizer.optimizer, zerodp.optim.LARC)
    d = make_model()
    larc = zerodp.optim.LARC(torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-6),
                             trust_coefficient=0.001, clip=False, eps=1e-8)
    ed = zerodp.initialize(d, larc, {"zero_optimization": {"stage": 2}})
    same_vissl = all(torch.equal(p, q) for p, q in zip(train(ec, c), train(ed, d)))
    assert yaml.safe_load(open(yaml_path))["MODEL"]["SHARDED_DDP_SETUP"]["USE_SDP"] is True
    return same_ds and same_vissl


@pytest.mark.parametrize("world", [2])
def test_config_built_optimizers(dist_run, world, tmp_path):
    path = tmp_path / "vissl.yaml"
    path.write_text(VISSL_YAML)
    assert dist_run(world, config_section_vs_explicit, str(path)) == [True] * world
