"""WholeTensorLayout arithmetic, the whole-tensor registry and the refusal message (no process group)."""

import pytest
import torch

import zerodp
from zerodp.errors import OptimizerError
from zerodp.shard.flat.buffer import FlatBuffer
from zerodp.shard.flat.whole_tensor_layout import WholeTensorLayout
from zerodp.optim.inner import check_supported, needs_whole_tensors, resolve_optimizer


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_every_tensor_lies_in_one_shard_and_shards_are_even(num_shards):
    shapes = [(7, 3), (5,), (4, 4), (2, 9), (1,), (13,)]
    layout = WholeTensorLayout.of(shapes, num_shards)
    assert layout.padded_numel == layout.shard_numel * num_shards
    seen = []
    for shard in range(num_shards):
        segs = layout.segments(shard)
        start = 0
        for seg in segs:  # whole tensors, packed from the shard's start in layout order
            assert (seg.param_start, seg.param_end) == (0, layout.numels[seg.param_index])
            assert seg.shard_start == start
            start += seg.numel
            seen.append(seg.param_index)
        assert start == layout.shard_loads[shard]
    assert sorted(seen) == list(range(len(shapes)))
    assert max(layout.shard_loads) == layout.shard_numel
    # greedy largest-first: no shard exceeds the fair share by more than the largest tensor
    assert layout.shard_numel <= -(-layout.numel // num_shards) + max(layout.numels)


def test_buffer_padding_between_shards_is_zero():
    layout = WholeTensorLayout.of([(3, 3), (2,), (4,)], 2)  # loads 9 and 6: a gap of 3 in shard 1
    buf = FlatBuffer(layout, torch.float32, torch.device("cpu"), data=torch.full((layout.padded_numel,), 7.0))
    buf.copy_from([torch.ones(3, 3), torch.ones(2), torch.ones(4)])
    assert buf.tensor.sum().item() == 15.0  # only parameter elements are non-zero
    assert layout.padding_ranges() == [(15, 18)]


def test_muon_and_adafactor_need_whole_tensors_and_unknown_optimizers_point_to_registration():
    p = torch.nn.Parameter(torch.randn(3, 4))
    assert needs_whole_tensors(torch.optim.Muon([p])) and needs_whole_tensors(torch.optim.Adafactor([p]))
    check_supported(torch.optim.Muon([p]), allow_untested=False)

    class Shampoo(torch.optim.SGD):
        pass

    with pytest.raises(OptimizerError, match=r"register_whole_tensor\(Shampoo\)"):
        check_supported(Shampoo([p], lr=0.1), allow_untested=False)
    zerodp.optim.register_whole_tensor(Shampoo)
    check_supported(Shampoo([p], lr=0.1), allow_untested=False)
    assert needs_whole_tensors(Shampoo([p], lr=0.1))
    with pytest.raises(OptimizerError, match="Optimizer subclass"):
        zerodp.optim.register_whole_tensor(object)


def test_a_list_of_optimizers_must_be_disjoint():
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4))
    opt = resolve_optimizer([torch.optim.Muon([a]), torch.optim.AdamW([b])], None, [a, b])
    assert [type(o) for o in opt.optimizers] == [torch.optim.Muon, torch.optim.AdamW]
    assert len(opt.param_groups) == 2
    with pytest.raises(OptimizerError, match="both hold a parameter"):
        resolve_optimizer([torch.optim.Muon([a]), torch.optim.AdamW([a, b])], None, [a, b])
    with pytest.raises(OptimizerError, match="not a torch.optim.Optimizer"):
        resolve_optimizer([torch.optim.Muon([a]), "adamw"], None, [a, b])
    with pytest.raises(OptimizerError, match="LAMB cannot be one of several optimizers"):
        check_supported(resolve_optimizer([torch.optim.Muon([a]), zerodp.optim.LAMB([b])], None, [a, b]), False)


def test_estimator_reports_whole_tensor_imbalance(capsys):
    from zerodp.tools.cli.main import main
    from zerodp.tools.plan import whole_tensor_shard_numel

    assert whole_tensor_shard_numel([(4, 4), (4, 4), (4, 4)], 2) == 32  # two matrices on one rank: 32 vs 24
    assert whole_tensor_shard_numel([(4, 4), (4, 4)], 2) == 16          # balanced: exactly Psi/N
    assert main(["estimate", "--model", "tiny", "--world-size", "3", "--optimizer", "adafactor"]) == 0
    out = capsys.readouterr().out
    assert "whole-tensor ownership (adafactor" in out and "the fullest rank owns" in out


def test_unpadded_layout_has_unequal_shards_balanced_across_units():
    from zerodp.shard.flat.whole_tensor_layout import UnpaddedWholeTensorLayout

    block = [(42, 14), (14, 14), (56, 14), (14, 56)]  # a GPT block's matrices: 588, 196, 784, 784
    first = UnpaddedWholeTensorLayout.after(block, 8)
    assert first.padded_numel == first.numel == 2352 and first.padding_ranges() == []
    assert first.shard_loads == (784, 784, 588, 196, 0, 0, 0, 0)  # four ranks own nothing here
    assert [first.shard_size(r) for r in range(8)] == list(first.shard_loads)
    second = UnpaddedWholeTensorLayout.after(block, 8, first.loads_after)
    assert second.shard_loads == (0, 0, 0, 0, 784, 784, 588, 196)  # ... and take the next block's matrices
    assert max(second.loads_after) == 784  # the largest matrix: the floor of any whole-tensor split
    for layout in (first, second):
        buf = FlatBuffer(layout, torch.float32, torch.device("cpu"))
        for r in range(8):  # shard r is exactly rank r's tensors, whole, one after another in rank order
            lo, hi = layout.shard_range(r)
            segs = layout.segments(r)
            assert sum(s.numel for s in segs) == hi - lo == buf.shard(r).numel()
            assert all((s.param_start, s.param_end) == (0, layout.numels[s.param_index]) for s in segs)
            assert all(layout.owners(s.param_index) == [r] for s in segs)
    with pytest.raises(ValueError, match="base_loads"):
        UnpaddedWholeTensorLayout.after(block, 8, (0, 0))
