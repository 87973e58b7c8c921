"""The bundled GPT and byte corpus: shapes, tying, determinism, rank slicing, and that it learns."""

import pytest
import torch

from zerodp.tools.app.corpus import ByteCorpus
from zerodp.tools.models.gpt import GPT, MODEL_PRESETS, GPTConfig, lm_loss


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_stdlib()


@pytest.fixture(scope="module")
def tiny() -> GPT:
    return GPT(MODEL_PRESETS["tiny"], seed=0)


def test_forward_shapes(tiny):
    idx = torch.randint(0, 256, (3, 17))
    assert tiny(idx).shape == (3, 17, 256)
    with pytest.raises(ValueError):
        tiny(torch.zeros(1, tiny.config.block_size + 1, dtype=torch.long))


def test_tied_weight_is_one_parameter(tiny):
    assert tiny.lm_head.weight is tiny.wte.weight
    names = [n for n, _ in tiny.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    untied = GPT(GPTConfig(n_layer=1, n_embd=32, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight


def test_attention_has_no_bias(tiny):
    for block in tiny.blocks:
        assert block.attn.qkv.bias is None and block.attn.proj.bias is None


def test_seeded_init_is_deterministic_and_gpt2_scaled():
    cfg = MODEL_PRESETS["tiny"]
    a, b = GPT(cfg, seed=1), GPT(cfg, seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    residual = a.blocks[0].mlp.proj.weight.std().item()
    assert residual == pytest.approx(0.02 / (2 * cfg.n_layer) ** 0.5, rel=0.1)
    assert torch.all(a.blocks[0].mlp.fc.bias == 0)


def test_generate_length(tiny):
    g = torch.Generator().manual_seed(0)
    prompt = torch.zeros(2, 5, dtype=torch.long)
    out = tiny.generate(prompt, 7, top_k=10, generator=g)
    assert out.shape == (2, 12) and torch.equal(out[:, :5], prompt)
    # Crops the context to block_size rather than failing.
    long = tiny.generate(torch.zeros(1, tiny.config.block_size, dtype=torch.long), 3)
    assert long.shape == (1, tiny.config.block_size + 3)
    greedy = [tiny.generate(prompt, 4, temperature=0) for _ in range(2)]
    assert torch.equal(greedy[0], greedy[1])


def test_corpus_is_deterministic(corpus):
    assert corpus.train.dtype == torch.uint8 and len(corpus.train) > 1_000_000
    assert len(corpus.val) == pytest.approx(0.05 * (len(corpus.train) + len(corpus.val)), abs=1)
    x1, y1 = corpus.batch(step=3, rank=0, world_size=2, micro_batch=4, seq_len=32)
    x2, y2 = corpus.batch(step=3, rank=0, world_size=2, micro_batch=4, seq_len=32)
    assert x1.dtype == torch.int64 and x1.shape == (4, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one byte
    x3, _ = corpus.batch(step=4, rank=0, world_size=2, micro_batch=4, seq_len=32)
    x4, _ = corpus.batch(step=3, rank=0, world_size=2, micro_batch=4, seq_len=32, micro_step=1)
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)
    assert ByteCorpus.from_stdlib().train is not corpus.train  # fresh object, cached read
    assert torch.equal(ByteCorpus.from_stdlib().train, corpus.train)


def test_encode_decode_roundtrip():
    text = "def f(x):\n    return x  # é\n"
    assert ByteCorpus.decode(ByteCorpus.encode(text)) == text
    assert ByteCorpus.decode([0xFF, 65]) == "\ufffdA"


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("split", ["train", "val"])
def test_rank_slices_concatenate_to_global_batch(corpus, world_size, split):
    micro_batch, seq_len = 2, 16
    for step, micro_step in [(0, 0), (5, 1)]:
        parts = [
            corpus.batch(step, r, world_size, micro_batch, seq_len, micro_step, split=split)
            for r in range(world_size)
        ]
        gx, gy = corpus.global_batch(step, world_size * micro_batch, seq_len, micro_step, split)
        assert torch.equal(torch.cat([p[0] for p in parts]), gx)
        assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_global_batch_independent_of_world_size(corpus):
    one = corpus.batch(7, 0, 1, 6, 16)[0]
    three = torch.cat([corpus.batch(7, r, 3, 2, 16)[0] for r in range(3)])
    assert torch.equal(one, three)


def test_tiny_gpt_learns_the_corpus(corpus):
    torch.manual_seed(0)
    cfg = MODEL_PRESETS["tiny"]
    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(30):
        x, y = corpus.batch(step, 0, 1, micro_batch=8, seq_len=cfg.block_size)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
