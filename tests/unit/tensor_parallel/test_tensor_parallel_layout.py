"""Tensor-parallel pieces without a process group: the TP=1 GPT is gpt.py's GPT, shard specs slice and merge,
vocab-parallel cross entropy at tp=1 is torch's, and the RNG tracker's streams."""

import torch

from zerodp.tools.models.gpt import GPT, GPTConfig, lm_loss
from zerodp.tools.models.tp_gpt import TensorParallelGPT, tp_lm_loss
from zerodp.tensor_parallel import (RNGStatesTracker, ShardSpec, merge_shards, seed_model_parallel, shard_tensor,
                                    tensor_parallel_specs)

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)


def test_tp1_gpt_is_gpt():
    ref, tp = GPT(CONFIG, seed=3), TensorParallelGPT(CONFIG, seed=3)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in tp.named_parameters()]
    for (name, a), b in zip(ref.named_parameters(), tp.parameters()):
        assert torch.equal(a, b), name
    idx = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    la, lb = ref(idx), tp(idx)
    assert torch.equal(la, lb)
    targets = idx.roll(-1, 1)
    lossa, lossb = lm_loss(la, targets), tp_lm_loss(lb, targets)
    # the vocab-parallel form computes log-sum-exp in its own order: equal to fp32 rounding
    torch.testing.assert_close(lossa, lossb, rtol=1e-6, atol=1e-6)
    lossa.backward()
    lossb.backward()
    for (name, a), b in zip(ref.named_parameters(), tp.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_specs_of_the_tp_gpt():
    specs = tensor_parallel_specs(TensorParallelGPT(CONFIG, seed=0))
    assert specs["wte.weight"] == ShardSpec(0, 1)
    assert specs["blocks.0.attn.qkv.weight"] == ShardSpec(0, 3)
    assert specs["blocks.0.mlp.fc.bias"] == ShardSpec(0, 1)
    assert specs["blocks.1.mlp.proj.weight"] == ShardSpec(1, 1)
    for replicated in ("wpe.weight", "ln_f.weight", "blocks.0.mlp.proj.bias", "blocks.0.ln_1.bias"):
        assert replicated not in specs


def test_megatron_attribute_is_read():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[0].weight.tensor_model_parallel = True
    model[0].weight.partition_dim = 1
    assert tensor_parallel_specs(model) == {"0.weight": ShardSpec(1, 1)}


def test_strided_shards_merge_back():
    whole = torch.arange(24.0).view(12, 2)
    spec = ShardSpec(0, 3)
    shards = [shard_tensor(whole, spec, t, 2) for t in range(2)]
    assert shards[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]  # rank 0: first half of each of q, k, v
    assert torch.equal(merge_shards(shards, spec), whole)


def test_tracker_streams():
    tracker = RNGStatesTracker("cpu")
    seed_model_parallel(tracker, 5, 1)
    default_first = torch.rand(3)
    with tracker.fork():
        mp_first = torch.rand(3)
    after = torch.rand(3)
    seed_model_parallel(tracker, 5, 1)
    assert torch.equal(torch.rand(3), default_first)  # the fork did not move the default stream
    assert torch.equal(torch.rand(3), after)
    with tracker.fork():
        assert torch.equal(torch.rand(3), mp_first)
    other = RNGStatesTracker("cpu")
    seed_model_parallel(other, 5, 0)
    with other.fork():
        assert not torch.equal(torch.rand(3), mp_first)  # another tensor-parallel rank draws another stream


def test_bad_inputs_get_one_clear_error(tmp_path):
    import pytest

    from zerodp.checkpoint.tensor_parallel import load_dir_for, tp_dir
    from zerodp.errors import CheckpointError
    from zerodp.optim.model_parallel import data_parallel_group
    from zerodp.tensor_parallel import merge_state_dicts

    class NoDataParallel:
        def get_model_parallel_group(self):
            return None

    with pytest.raises(TypeError, match="lacks get_model_parallel_rank.*get_data_parallel_group"):
        data_parallel_group(NoDataParallel(), None)

    class Mpu:  # Megatron-LM's newer spellings only
        def __getattr__(self, name):
            if "tensor_model_parallel" in name or "data_parallel" in name:
                return lambda: "group" if name.endswith("group") else 0
            raise AttributeError(name)

    assert data_parallel_group(Mpu(), None) == "group"
    with pytest.raises(ValueError, match="either process_group= or mpu="):
        data_parallel_group(Mpu(), object())
    import zerodp.tensor_parallel.layers as layers

    with pytest.MonkeyPatch.context() as mp:  # the size checks run before any collective
        mp.setattr(layers, "group_rank_and_size", _fake_rank_and_size)
        with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
            TensorParallelGPT(CONFIG, _FakeMpu(3))
    with pytest.raises(ValueError, match="does not split into 3 block"):
        shard_tensor(torch.zeros(6, 2), ShardSpec(0, 3), 0, 4)
    with pytest.raises(ValueError, match="other keys"):
        merge_state_dicts([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], {})
    with pytest.raises(CheckpointError, match="no tensor-parallel checkpoint"):
        load_dir_for(tmp_path, 0, 2)
    tp_dir(tmp_path, 0, 2).mkdir()
    with pytest.raises(CheckpointError, match="saved at tensor-parallel size 2, this run has 4"):
        load_dir_for(tmp_path, 0, 4)
    assert load_dir_for(tmp_path, 1, 2) == tmp_path / "tp-01-of-02"


class _FakeMpu:
    """A tensor-parallel group of `size` ranks as seen by the layers' size checks (no process group needed)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_tensor_model_parallel_group(self):
        return self


def _fake_rank_and_size(group):
    return (0, 1) if group is None else (0, group.size)


def test_tensor_parallel_without_marked_parameters_is_logged(caplog):
    from zerodp.optim.model_parallel import model_parallel_norm

    class Mpu:
        def __getattr__(self, name):
            return lambda: 2 if name.endswith("world_size") else (None if name.endswith("group") else 0)

    with caplog.at_level("WARNING", logger="zerodp"):
        rule = model_parallel_norm(Mpu(), torch.nn.Linear(2, 2))
    assert rule.world_size == 2 and not rule.sharded_ids
    assert "marks no parameter as tensor-parallel" in caplog.text
    caplog.clear()
    rule = model_parallel_norm(Mpu(), TensorParallelGPT(CONFIG, seed=0))
    # wte; per block attn.qkv.weight, attn.proj.weight, mlp.fc.weight and .bias, mlp.proj.weight
    assert len(rule.sharded_ids) == 1 + 2 * 5 and not caplog.text


def test_tp1_generate_is_gpt_generate():
    ref, tp = GPT(CONFIG, seed=3), TensorParallelGPT(CONFIG, seed=3)
    prompt = torch.tensor([[1, 2, 3]])
    a = ref.generate(prompt, 6, top_k=5, generator=torch.Generator().manual_seed(1))
    b = tp.generate(prompt, 6, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (1, 9)
