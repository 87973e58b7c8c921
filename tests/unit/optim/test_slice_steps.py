"""The MoE step's reuse (optim/chunk_pieces.py, optim/slice_steps.py): pieces cut once are the layout's segments
cut at the chunks; the slice step's temporary optimizer is built once and follows the group's options; its cached
views follow a replaced state and do not keep the old one alive; and the step stays bitwise torch's AdamW (foreach)
on a 16-expert MoE, with chunks that cut parameters in the middle and chunks whose parameters all got a gradient
beside chunks that hold unrouted experts (one process; the step's time: bench/moe_optimizer_step.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.oracle import train_reference
from tests.dist.moe_common import IN, OUT, ClassicMoE
from zerodp.optim import optimizer as sharded_optimizer
from zerodp.optim import slice_steps
from zerodp.optim.chunk_pieces import ChunkPieces
from zerodp.shard.flat.layout import FlatLayout

STEPS = 8


class _Unit:
    def __init__(self, layout: FlatLayout, shard_index: int) -> None:
        self.layout, self.shard_index = layout, shard_index


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("chunk_numel", [5, 16, 1000])
def test_pieces_are_the_segments_cut_at_the_chunks(num_shards, chunk_numel):
    layout = FlatLayout.of([(3, 4), (7,), (2, 5), (1,), (9, 2)], num_shards)
    for shard in range(num_shards):
        master = torch.zeros(layout.shard_numel)
        chunks = list(master.split(chunk_numel))
        owner = torch.full((layout.shard_numel,), -1)  # the parameter of each element, from the segments
        for seg in layout.segments(shard):
            owner[seg.shard_start:seg.shard_start + seg.numel] = seg.param_index
        (cut,) = ChunkPieces([_Unit(layout, shard)], [chunks], [False]).of_unit
        assert [c for c, _ in cut] == chunks
        got = torch.full((layout.shard_numel,), -1)
        start = 0
        for chunk, pieces in cut:
            assert all(a.stop <= b.start for a, b in zip(pieces, pieces[1:])), pieces  # in layout order
            for piece in pieces:
                assert 0 <= piece.start < piece.stop <= chunk.numel()
                got[start + piece.start:start + piece.stop] = piece.param
            start += chunk.numel()
        assert torch.equal(got, owner)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, IN, generator=g), torch.randn(4, OUT, generator=g)


def _train(stage: int, monkeypatch, reload_at=None):
    """A 16-expert MoE trained by torch's AdamW (foreach) and by zerodp side by side, with an lr changed at every
    step; returns (torch's parameters, zerodp's, the engine's optimizer, temporaries built, whether a state tensor
    replaced at step `reload_at` was freed at once)."""
    # chunks of 3000 elements: experts (2 x 2048) cut in the middle, several chunks per unit
    monkeypatch.setattr(sharded_optimizer, "OPTIMIZER_CHUNK_NUMEL", 3000)
    built = []
    rebuild = slice_steps.rebuild
    monkeypatch.setattr(slice_steps, "rebuild", lambda *a: built.append(rebuild(*a)) or built[-1])
    torch.manual_seed(0)
    ref_model = ClassicMoE(width=32, experts=16, layers=1)
    model = ClassicMoE(width=32, experts=16, layers=1)
    model.load_state_dict(ref_model.state_dict())

    def lr_of_step(_model, optimizer, step: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 / (1 + step)  # reaches the slices' temporary optimizer only if it follows the group

    ref = train_reference(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1,
                                                       foreach=True),
                          STEPS, lambda m, step: F.mse_loss(m(_batch(step)[0]), _batch(step)[1]), before_step=lr_of_step)
    user = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    engine = zerodp.initialize(model, user, {"zero_optimization": {"stage": stage,
                                                                   "stage3_param_persistence_threshold": 0}})
    sharded, replaced, used = engine.optimizer, None, []
    planned = []  # per step: (chunks stepped slice by slice, chunks stepped whole in the same call)
    plan_of = sharded.step_counts.sliced_chunks

    def counting_plan(*args):
        plan = plan_of(*args)
        whole = sum(slices is None for _, _, slices in plan.values())
        planned.append((len(plan) - whole, whole))
        return plan

    monkeypatch.setattr(sharded.step_counts, "sliced_chunks", counting_plan)
    for step in range(STEPS):
        lr_of_step(model, user, step)
        x, y = _batch(step)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        used.append(set(model.used_experts()[0]))
        if step == reload_at:  # a checkpoint's round trip: every state tensor is replaced by an equal one
            states = [s for s in sharded.optimizer.state.values() if "exp_avg" in s]
            replaced = weakref.ref(states[0]["exp_avg"])
            del states
            for index in range(len(sharded.units)):
                sharded.load_state_of(index, sharded.state_of(index))
            gc.collect()
            replaced = replaced() is None  # checked before any step could refresh the cached views
    assert any(len(u) < 16 for u in used[1:]), "every expert was routed on every step: not the case"
    # some steps have chunks stepped slice by slice beside chunks stepped whole (one unit here, at every stage)
    assert any(sliced and whole for sliced, whole in planned[1:]), planned
    with zerodp.gathered_parameters(model.parameters()):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.close()
    return ref.params, got, sharded, built, replaced


@pytest.mark.parametrize("stage", [1, 3])
def test_the_moe_step_is_torch_adamw_bitwise_with_one_temporary_optimizer(stage, monkeypatch):
    ref, got, sharded, built, _ = _train(stage, monkeypatch)
    # the same update per element, the same tensors' boundaries where it matters: exact
    for key, value in ref.items():
        assert torch.equal(got[key], value), (key, (got[key] - value).abs().max().item())
    groups = len(sharded.optimizer.param_groups)
    assert 1 <= len(built) <= groups, f"{len(built)} temporary optimizers built for {groups} groups in {STEPS} steps"


def test_a_replaced_state_is_followed_and_released(monkeypatch):
    ref, got, _, _, released = _train(2, monkeypatch, reload_at=3)
    assert released, "a cached view keeps the replaced state tensor alive"
    for key, value in ref.items():  # the steps after the reload updated the new state, not the old
        assert torch.equal(got[key], value), (key, (got[key] - value).abs().max().item())


def test_cached_views_follow_state_tensors_put_in_place_of_the_old():
    """An offload window brings a chunk's state back in other buffers (new tensors in the same state dict): the
    slice step updates those, never the views it kept of the old ones."""
    chunk = torch.zeros(10)
    chunk.grad = torch.ones(10)
    member = torch.optim.AdamW([torch.zeros(1)], lr=0.1)
    states = {chunk: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(10), "exp_avg_sq": torch.zeros(10)}}
    steps = slice_steps.SliceSteps()
    steps.step(0, member, member.param_groups[0], states, [(chunk, slice(2, 5), 3)])
    old = dict(states[chunk])
    before = {k: v.clone() for k, v in old.items()}
    states[chunk].update({k: v.clone() for k, v in old.items() if k != "step"})
    steps.step(0, member, member.param_groups[0], states, [(chunk, slice(2, 5), 4)])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(old[key], before[key]), f"the old {key} was written"
        assert not torch.equal(states[chunk][key][2:5], before[key][2:5]), f"the new {key} was not updated"
        assert torch.equal(states[chunk][key][5:], before[key][5:])  # outside the slice: untouched
