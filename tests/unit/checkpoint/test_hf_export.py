"""Streaming consolidation into the Hugging Face layout (checkpoint/hf_export.py), from one-process
checkpoints: shard planning, the index, tied weights, dtypes, the single-file output, and the CLI's errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import zerodp
from tests.dist.common import make_model, make_optimizer, micro_batch
from zerodp import CheckpointError
from zerodp.checkpoint.hf_export import ExportedTensor, export_hf, parse_size, plan_shards
from zerodp.tools.cli.main import main as zerodp_main
from zerodp.tools.models.gpt import GPT, GPTConfig


@pytest.fixture
def ckpt(tmp_path):
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("adamw", model),
                               {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}})
    for step in range(2):
        x, y = micro_batch(step, 0, 0, 1, 4, 1)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_sizes_read_like_save_pretrained():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5 kib") == 1536 and parse_size(4096) == 4096
    assert parse_size("123") == 123
    for bad in ("5 parsecs", "GB", "-1GB", "0"):
        with pytest.raises(CheckpointError, match="size"):
            parse_size(bad)


def test_shards_split_in_order_and_a_big_tensor_gets_its_own():
    ts = [ExportedTensor(f"t{i}", f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 5])]
    plan = [[t.key for t in shard] for shard in plan_shards(ts, 80)]  # 40, 40, 120, 20, 20 bytes
    assert plan == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [[t.key for t in s] for s in plan_shards(ts, 10**6)] == [["t0", "t1", "t2", "t3", "t4"]]


def test_one_shard_is_model_safetensors_without_index(ckpt, tmp_path):
    result = export_hf(ckpt, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    loaded = load_file(tmp_path / "hf" / "model.safetensors")
    expected = zerodp.consolidate_checkpoint(ckpt)
    assert set(loaded) == set(expected) and result.tensors == len(expected)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in expected.items())
    assert result.total_bytes == nbytes(expected)


def test_small_shards_get_an_index_and_a_reexport_removes_stale_files(ckpt, tmp_path):
    out = tmp_path / "hf"
    export_hf(ckpt, out, max_shard_size="200B", piece_bytes=16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    expected = zerodp.consolidate_checkpoint(ckpt)
    assert set(index["weight_map"]) == set(expected) and set(index["weight_map"].values()) == set(shards)
    written = {}
    for name in shards:
        tensors = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in tensors)
        assert nbytes(tensors) <= 200 or len(tensors) == 1
        written.update(tensors)
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    assert index["metadata"]["total_size"] == nbytes(expected)
    (out / "notes.txt").write_text("mine")
    export_hf(ckpt, out)  # now one file: the shards and the index of the first export must go
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]


def test_tied_weights_once_in_a_folder_under_every_name_in_one_file(tmp_path):
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8), seed=0)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    engine.save_checkpoint(tmp_path / "ckpt")
    assert zerodp_main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    folder = load_file(tmp_path / "hf" / "model.safetensors")
    assert "wte.weight" in folder and "lm_head.weight" not in folder
    assert zerodp_main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "one.safetensors")]) == 0
    single = load_file(tmp_path / "one.safetensors")
    assert torch.equal(single["lm_head.weight"], single["wte.weight"])
    plain = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8), seed=1)
    plain.load_state_dict(single, strict=True)
    plain.load_state_dict(folder, strict=False)  # a tied model gets lm_head from wte
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())


def test_bf16_frozen_weights_upcast_and_integer_buffers_kept(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model[0].to(torch.bfloat16).requires_grad_(False)
    model[1].num_batches_tracked.fill_(7)
    engine = zerodp.initialize(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                               {"train_micro_batch_size_per_gpu": 8})
    engine.save_checkpoint(tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "hf", piece_bytes=8)
    loaded = load_file(tmp_path / "hf" / "model.safetensors")
    assert loaded["0.weight"].dtype == torch.float32 and torch.equal(loaded["0.weight"], model[0].weight.float())
    assert loaded["1.num_batches_tracked"].dtype == torch.int64 and loaded["1.num_batches_tracked"].item() == 7


def test_cli_errors_are_one_line(ckpt, tmp_path, capsys):
    cases = [([str(tmp_path / "m.safetensors"), "--max-shard-size", "1GB"], "apply to a folder output"),
             ([str(tmp_path / "hf"), "--max-shard-size", "5 parsecs"], "cannot read the size"),
             ([str(tmp_path / "hf"), "--config", str(tmp_path / "nowhere")], "config.json"),
             ([str(tmp_path / "hf"), "--tag", "nope"], "tag 'nope' not found")]
    for args, message in cases:
        assert zerodp_main(["consolidate", str(ckpt)] + args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.safetensors").exists()
