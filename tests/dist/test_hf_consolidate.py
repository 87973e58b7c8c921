"""`zerodp consolidate` into the Hugging Face layout, from a tiny GPT-2 trained at stage 3 on 2 gloo ranks:
`GPT2LMHeadModel.from_pretrained(out)` loads the shards (through the index) and gives the live engine's
logits; every file's tensors equal `consolidate_checkpoint`'s, also when read in pieces that cross the
ranks' segments."""

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zerodp
from zerodp.checkpoint import consolidate_main
from zerodp.checkpoint.hf_export import export_hf

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, MICRO_BS, STEPS = 8, 40, 2, 3


def make_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=24, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def train_save_consolidate(work: str) -> dict:
    """Train STEPS steps at stage 3, save, consolidate on rank 0 (CLI, 20KB shards) and load it back there."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_gpt2()
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                               {"train_micro_batch_size_per_gpu": MICRO_BS,
                                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                      "stage3_unit_modules": ["GPT2Block"]}})
    for step in range(STEPS):
        ids = batch(step, MICRO_BS * world)[rank * MICRO_BS:(rank + 1) * MICRO_BS]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(f"{work}/ckpt")
    engine.eval()
    probe = batch(99, 3)
    with torch.no_grad():
        live = engine(input_ids=probe).logits  # every rank runs it: the stage-3 gathers are collectives
    if rank != 0:
        return {}
    model.config.save_pretrained(f"{work}/config")
    code = consolidate_main([f"{work}/ckpt", f"{work}/hf", "--max-shard-size", "20KB", "--config", f"{work}/config"])
    loaded = transformers.GPT2LMHeadModel.from_pretrained(f"{work}/hf").eval()
    with torch.no_grad():
        logits = loaded(input_ids=probe).logits
    return {"code": code, "live": live, "loaded": logits,
            "tied": loaded.lm_head.weight is loaded.transformer.wte.weight,
            "loaded_state": {k: v.clone() for k, v in loaded.state_dict().items()}}


@pytest.mark.parametrize("world", [2])
def test_gpt2_from_pretrained_matches_the_live_model(dist_run, tmp_path, world):
    result = dist_run(world, train_save_consolidate, str(tmp_path))[0]
    assert result["code"] == 0
    # same weights, same ops, same process and threads: the logits agree bit for bit
    assert torch.equal(result["loaded"], result["live"])
    assert result["tied"], "from_pretrained must tie lm_head to wte again"
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["n_embd"] == 24
    expected = zerodp.consolidate_checkpoint(tmp_path / "ckpt")
    # the tied copy is dropped as save_pretrained drops it; everything else is written once
    assert set(index["weight_map"]) == set(expected) - {"lm_head.weight"}
    written = {}
    for name in shards:
        tensors = load_file(out / name)
        assert all(index["weight_map"][key] == name for key in tensors), name
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000 or len(tensors) == 1
        written.update(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    for key, value in written.items():
        assert torch.equal(value, expected[key]), key
        assert torch.equal(result["loaded_state"][key], value), key
    # pieces of 10 elements cross the two ranks' segment boundaries inside most tensors
    export_hf(tmp_path / "ckpt", tmp_path / "pieces", piece_bytes=40)
    pieces = load_file(tmp_path / "pieces" / "model.safetensors")
    assert set(pieces) == set(expected) - {"lm_head.weight"}
    assert all(torch.equal(pieces[k], expected[k]) for k in pieces)
