"""The analytic memory model against the ZeRO paper's formulas and tables, and against torch."""

import pytest
import torch

from zerodp.tools.models.gpt import GPT, MODEL_PRESETS, lm_loss
from zerodp.tools.plan import (
    ModelStateBytes,
    estimate_activation_bytes,
    estimate_model_numel,
    format_bytes,
    max_model_numel,
    paper_round,
    paper_table,
    precision_bytes,
    predict_model_state_bytes,
    render_paper_table,
)

MIXED_ADAM = dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12)


@pytest.mark.parametrize(
    "stage, expected",
    [
        # (params, grads, optimizer) in units of Psi, for N = 8 ranks.
        (0, (2, 2, 12)),
        (1, (2, 2, 12 / 8)),
        (2, (2, 2 / 8, 12 / 8)),
        (3, (2 / 8, 2 / 8, 12 / 8)),
    ],
)
def test_stage_formulas(stage, expected):
    psi = 1000
    got = predict_model_state_bytes(psi, 8, stage, **MIXED_ADAM)
    assert (got.params, got.grads, got.optimizer) == pytest.approx([psi * e for e in expected])
    assert got.total == pytest.approx(psi * sum(expected))


def test_paper_totals_per_stage():
    psi, n = 7.5e9, 64
    totals = [predict_model_state_bytes(int(psi), n, s, **MIXED_ADAM).total for s in range(4)]
    assert totals[0] == 16 * psi
    assert totals[1] == pytest.approx(4 * psi + 12 * psi / n)
    assert totals[2] == pytest.approx(2 * psi + 14 * psi / n)
    assert totals[3] == pytest.approx(16 * psi / n)
    # Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    assert [round(t / 1e9, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_model_state_bytes_add():
    a = ModelStateBytes(1, 2, 3) + ModelStateBytes(10, 20, 30)
    assert a == ModelStateBytes(11, 22, 33) and a.total == 66


def test_invalid_stage_and_world_size():
    with pytest.raises(ValueError):
        predict_model_state_bytes(10, 2, 4, **MIXED_ADAM)
    with pytest.raises(ValueError):
        predict_model_state_bytes(10, 0, 1, **MIXED_ADAM)


@pytest.mark.parametrize(
    "precision, optimizer, expected",
    [
        ("mixed", "adam", (2, 2, 12)),
        ("mixed", "adamw", (2, 2, 12)),
        ("mixed", "lamb", (2, 2, 12)),
        ("mixed", "sgd", (2, 2, 8)),
        ("mixed", "sgd-nomomentum", (2, 2, 4)),
        ("mixed", "adagrad", (2, 2, 8)),
        ("fp32", "adam", (4, 4, 8)),
        ("fp32", "sgd", (4, 4, 4)),
        ("fp32", "sgd-nomomentum", (4, 4, 0)),
    ],
)
def test_precision_bytes(precision, optimizer, expected):
    assert precision_bytes(precision, optimizer) == expected


def test_precision_bytes_rejects_unknown():
    with pytest.raises(ValueError):
        precision_bytes("fp8")
    with pytest.raises(ValueError):
        precision_bytes("mixed", "rmsprop")


# Table 1 of the paper as printed (per-device GB; the DP=1 row is the baseline).
DP_DEGREES = [1, 4, 16, 64, 256, 1024]
PAPER_TABLE_1 = {
    7.5e9: [
        ("120", "120", "120"),
        ("52.5", "41.3", "30"),
        ("35.6", "21.6", "7.5"),
        ("31.4", "16.6", "1.88"),
        ("30.4", "15.4", "0.47"),
        ("30.1", "15.1", "0.12"),
    ],
    128e9: [
        ("2048", "2048", "2048"),
        ("896", "704", "512"),
        ("608", "368", "128"),
        ("536", "284", "32"),
        ("518", "263", "8"),
        ("513", "257", "2"),
    ],
    1e12: [
        ("16000", "16000", "16000"),
        ("7000", "5500", "4000"),
        ("4750", "2875", "1000"),
        ("4187", "2218", "250"),
        ("4046", "2054", "62.5"),
        ("4011", "2013", "15.6"),
    ],
}


@pytest.mark.parametrize("params", sorted(PAPER_TABLE_1))
def test_paper_table_1(params):
    rows = paper_table(params, DP_DEGREES)
    got = [(paper_round(r.os_gb), paper_round(r.os_g_gb), paper_round(r.os_g_p_gb)) for r in rows]
    assert got == PAPER_TABLE_1[params]
    assert [r.world_size for r in rows] == DP_DEGREES


def test_paper_round_rule():
    assert paper_round(513.5) == "513"  # >= 100: truncated, as the paper does
    assert paper_round(41.25) == "41.3"  # half-up, 3 significant digits
    assert paper_round(0.46875) == "0.47"  # at most 2 decimals
    assert paper_round(30.0) == "30"


def test_render_paper_table():
    text = render_paper_table([7.5e9, 128e9, 1e12], DP_DEGREES)
    lines = text.splitlines()
    assert lines[0].startswith("| DP | 7.5B Pos | 7.5B Pos+g | 7.5B Pos+g+p | 128B Pos")
    assert lines[5] == "| 64 | 31.4 | 16.6 | 1.88 | 536 | 284 | 32 | 4187 | 2218 | 250 |"


def test_paper_table_2_max_model_size():
    # 64 GPUs with 32 GB each, MP=1: baseline 2B, Pos 7.6B, Pos+g 14.4B, Pos+g+p 128B.
    sizes = [max_model_numel(32e9, 64, stage, **MIXED_ADAM) / 1e9 for stage in range(4)]
    assert [round(s, 1) for s in sizes] == [2.0, 7.6, 14.4, 128.0]
    # MP=16 on 1024 GPUs (DP=64): the paper multiplies the MP=1 sizes (rounded) by 16.
    assert [16 * s for s in sizes] == pytest.approx([32, 121.6, 230.4, 2048], rel=0.01)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_estimate_model_numel_matches_gpt(name):
    cfg = MODEL_PRESETS[name]
    assert estimate_model_numel(cfg) == GPT(cfg).num_parameters()


def test_estimate_model_numel_untied():
    cfg = MODEL_PRESETS["tiny"]
    untied = type(cfg)(**{**cfg.__dict__, "tie_embeddings": False})
    assert estimate_model_numel(untied) == GPT(untied).num_parameters()
    assert estimate_model_numel(untied) - estimate_model_numel(cfg) == 256 * cfg.n_embd


def _saved_activation_bytes(model, idx, targets) -> int:
    """Bytes of the unique non-parameter storages autograd saves for one forward + loss."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(idx), targets)
    del loss
    return sum(saved.values())


def test_activation_estimate_matches_saved_tensors():
    cfg = MODEL_PRESETS["tiny"]
    model = GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    b, t = 3, cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    measured = _saved_activation_bytes(model, idx, targets)
    estimated = estimate_activation_bytes(cfg, b, t, dtype_bytes=4)
    assert measured / 2 <= estimated <= measured * 2
    # Checkpointing keeps far less; half precision halves the BTC terms.
    assert estimate_activation_bytes(cfg, b, t, 4, checkpointing=True) < estimated
    assert estimate_activation_bytes(cfg, b, t, 2) < estimated


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_bytes(2048) == "2.00 KiB"
