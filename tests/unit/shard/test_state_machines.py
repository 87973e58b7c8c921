"""The gradient life cycle (one GradShard for every stage) and stage 3's module-unit training state
are enums whose illegal transitions fail loudly instead of hanging in a collective."""

import pytest
import torch
from torch import nn

from zerodp import comm
from zerodp.shard.grads.grad_arithmetic import GradArithmetic
from zerodp.shard.grads.grad_shard import GradShard, GradState
from zerodp.shard.flat.layout import FlatLayout
from zerodp.shard.stage3.module_unit import ModuleUnit, TrainingState


def _shard(keep_full: bool) -> tuple[GradShard, list[nn.Parameter]]:
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    layout = FlatLayout.of([p.shape for p in params], 1)

    def reduce(output, full, async_op):  # one rank: the sum is the buffer itself
        return comm.Handle()

    return GradShard(params, layout, 0, GradArithmetic(1), reduce, keep_full=keep_full, name="test"), params


@pytest.mark.parametrize("keep_full", [True, False])
def test_grad_shard_life_cycle(keep_full):
    g, params = _shard(keep_full)
    assert g.state is GradState.IDLE
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1))
        g.add_grad(i)
        assert p.grad is None  # moved into the flat buffer
    assert g.complete and g.state is GradState.FILLING
    g.launch()
    assert g.state is GradState.REDUCING
    with pytest.raises(RuntimeError, match="cannot go from REDUCING to REDUCING"):
        g.launch()  # launching twice without waiting would issue a collective the other ranks never match
    g.wait()
    assert g.state is GradState.REDUCED and g.shard.tolist() == [1, 1, 1, 2, 2]
    params[0].grad = torch.ones(3)  # a late gradient opens a second round; nothing is reduced twice
    g.add_grad(0)
    g.launch()
    g.wait()
    assert g.shard.tolist() == [2, 2, 2, 2, 2]
    g.zero_grad()
    assert g.state is GradState.IDLE and g.shard.abs().sum() == 0 and not bool(g.received.any())


def test_grad_shard_refuses_a_backward_while_reducing():
    g, params = _shard(False)
    g.launch()
    with pytest.raises(RuntimeError, match="still reducing"):
        g.start_micro_step()


def test_module_unit_transitions_are_asserted():
    unit = ModuleUnit(nn.Linear(2, 2), "block", [], schedule=None, is_root=False)
    unit._to(TrainingState.FORWARD)
    with pytest.raises(RuntimeError, match="cannot go from FORWARD to BACKWARD"):
        unit._to(TrainingState.BACKWARD)
    unit._to(TrainingState.IDLE)
    unit._to(TrainingState.RECOMPUTE)
    with pytest.raises(RuntimeError, match="cannot go from RECOMPUTE to IDLE"):
        unit._to(TrainingState.IDLE)
