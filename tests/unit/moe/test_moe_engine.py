"""A model with MoE layers in one process (world size 1): the engine's expert-parallel strategy conforms to the
ShardingStrategy seam, and training equals plain PyTorch on the same model, stages 0-3."""

import copy

import pytest
import torch
import torch.nn.functional as F

import zerodp
from zerodp.shard import seams
from zerodp.moe.sharding import ExpertParallelSharding
from tests.oracle import train_reference
from tests.unit.shard.test_seams import conformance_errors


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.moe = zerodp.moe.MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=2, min_capacity=0,
                                  top2_2nd_expert_sampling=False)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        m, l_aux, _ = self.moe(h)
        return self.out(m), l_aux


def batches(steps):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_process_moe_engine_equals_plain_torch(stage):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        for i, e in enumerate(model.moe.moe.experts):
            e.weight.add_(0.1 * i)  # distinct experts
    plain = copy.deepcopy(model)

    def step_loss(net, step: int) -> torch.Tensor:
        x, y = data[step]
        out, l_aux = net(x)
        return F.mse_loss(out, y) + 0.1 * l_aux

    data = batches(5)
    train_reference(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1), len(data), step_loss,
                    clip=0.3)
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                               {"train_micro_batch_size_per_gpu": 10, "gradient_clipping": 0.3,
                                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    try:
        assert isinstance(engine.sharding, ExpertParallelSharding)
        assert not conformance_errors(engine.sharding, seams.ShardingStrategy)
        for x, y in data:
            out, l_aux = engine(x)
            engine.backward(F.mse_loss(out, y) + 0.1 * l_aux)
            engine.step()
        # one process, the same operations: fp32 rounding apart (the flat buffers change no arithmetic)
        with zerodp.gathered_parameters(model.parameters()):  # stage 3: the full values
            for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    finally:
        engine.close()
