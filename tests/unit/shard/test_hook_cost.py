"""[Note: hook cost] (grads/param_hook.py): the gradient hooks, which run once per parameter per backward, issue no
tensor operation of their own beyond moving the gradient (none at all where autograd accumulates into the buffer
view: [Note: gradients as buffer views]); the work per bucket or unit (launching its reduction) is bounded
per unit. Counted as operations under AccumulateGrad in torch.profiler's tree, not timed.

Stages 2-3 have two policies (placement.grad_views_every_round): on the CPU each gradient is copied into its round's
buffer; on an accelerator the buffer is handed to autograd as views, so only a round's first gradient is moved by
the hook. The accelerator's policy is tested here by patching the device's answer."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import zerodp
from zerodp.offload import placement
from zerodp.tools.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=6, n_head=2, n_embd=16)
PER_UNIT_OPS = 10  # a reduction's launch at world 1: slices of its buffer, a dtype conversion, an add


def hook_ops(stage: int, check=None):
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
        if check is not None:
            check(engine, model)
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


def no_grad_left(engine, model) -> None:
    """After a backward, gradients live in the gradient shards: no parameter keeps a .grad (a view left attached
    would take a stray backward's gradient, or point into a round's buffer once it is freed)."""
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize("stage", [2, 3])
def test_round_views_move_one_gradient_per_unit(stage, monkeypatch):
    monkeypatch.setattr(placement, "grad_views_every_round", lambda device: True)  # an accelerator's policy
    ops, calls, units, params = hook_ops(stage, no_grad_left)
    assert calls == params and params > 4 * units
    # a gradient taken out of autograd (AccumulateGrad's detach: the parameter had no .grad) and copied or added by
    # the hook: only the first of each round's buffer (one round per unit here); the others are added in place
    # the hook's first gradient of each round (one round per unit here), and the reduced slice's delivery (at world 1
    # inside the hook), a copy into the shard zero_grad left to its first delivery ([Note: zeroing on first delivery])
    taken = ops["aten::detach"] + ops["aten::copy_"]
    assert taken <= 2 * units, ops  # the copy path takes and copies every one of them: 2 per parameter
    assert ops["aten::zero_"] <= units, ops  # the buffer zeroed once per round


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_keeps_the_copy_path_at_stages_2_and_3(stage):
    assert not placement.grad_views_every_round(torch.device("cpu"))
    assert placement.grad_views_every_round(torch.device("cuda", 0))  # a value: no GPU needed
    ops, calls, units, params = hook_ops(stage, no_grad_left)
    assert ops["aten::zero_"] == 0, ops  # no pass over the buffer: each first gradient is copied
    # each gradient copied once, and at most one copy per unit for its reduced slice's delivery inside a hook (world
    # 1: [Note: zeroing on first delivery] in grads/grad_shard.py)
    assert params <= ops["aten::copy_"] <= params + units, ops
