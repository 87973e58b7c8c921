"""[Note: hook cost] (grads/grad_shard.py): the gradient hooks, which run once per parameter per backward, issue no
tensor operation of their own beyond moving the gradient (none at all where autograd accumulates into the buffer
view: [Note: gradients as buffer views]); the work per bucket or unit (launching its reduction) is bounded
per unit. Counted as operations under AccumulateGrad in torch.profiler's tree, not timed."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import zerodp
from zerodp.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=6, n_head=2, n_embd=16)
PER_UNIT_OPS = 10  # a reduction's launch at world 1: slices of its buffer, a dtype conversion, an add


def hook_ops(stage: int):
    torch.manual_seed(0)
    model = GPT(CFG)
    zero = {"stage": stage, **({"stage3_unit_modules": ["Block"]} if stage == 3 else {"reduce_bucket_size": 3000})}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_optimization": zero})
    x = torch.randint(64, (2, 9), generator=torch.Generator().manual_seed(0))
    for step in range(2):  # the second backward is the steady state
        loss = F.cross_entropy(engine(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1))
        if step == 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.backward(loss)
        else:
            engine.backward(loss)
        engine.step()
    ops = collections.Counter()
    calls = 0
    for event in prof.events():
        if event.name == "torch::autograd::AccumulateGrad":
            calls += 1
            ops.update(child.name for child in event.cpu_children)
    units = len(engine.optimizer.units)
    params = len(list(model.parameters()))
    engine.close()
    return ops, calls, units, params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_hooks_do_no_per_parameter_tensor_work(stage):
    ops, calls, units, params = hook_ops(stage)
    assert calls == params and units > 2
    moves = ops["aten::add_"] + ops["aten::copy_"]
    other = sum(ops.values()) - moves - ops["aten::detach"]  # detach: AccumulateGrad's own, taking a fresh grad
    # one move per parameter (autograd's in-place add into the view, or the hook's copy into the buffer)
    assert moves <= params + PER_UNIT_OPS * units, ops
    assert other <= PER_UNIT_OPS * units, ops  # was 5 per parameter: slice, view, a flag tensor's write
