"""A list of optimizer sections in the config (optim/selection.py): which parameters each selects,
and the one error for overlapping or uncovered parameters. No process group."""

import json

import pytest
import torch

import zerodp
from tests.dist.whole_tensor_common import MuonFP32, is_muon_param, make_gpt, register
from zerodp.config import load_config
from zerodp.errors import OptimizerError
from zerodp.optim.inner import resolve_optimizer
from zerodp.optimizers.optimizer_list import OptimizerList

MUON = {"type": "Muon", "select": "matrices", "params": {"lr": 0.02}}
ADAMW = {"type": "AdamW", "select": "rest", "params": {"lr": 1e-3, "weight_decay": 0.01}}  # DeepSpeed: 0 by default


def build(sections, model):
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": sections})
    return resolve_optimizer(None, cfg.optimizer, [p for p in model.parameters() if p.requires_grad], model=model)


def test_matrices_and_rest_split_a_tied_gpt_as_muon_users_do():
    model = make_gpt()
    opt = build([MUON, ADAMW], model)
    assert isinstance(opt, OptimizerList)
    muon, adamw = opt.optimizers
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    named = list(model.named_parameters())
    # 'matrices' leaves out the embeddings and the head tied to the token embedding
    assert [id(p) for p in muon.param_groups[0]["params"]] == [id(p) for n, p in named if is_muon_param(n, p)]
    assert [id(p) for p in adamw.param_groups[0]["params"]] == [id(p) for n, p in named if not is_muon_param(n, p)]
    assert muon.param_groups[0]["lr"] == 0.02 and adamw.param_groups[0]["lr"] == 1e-3


def test_name_patterns_match_any_name_of_a_tied_weight():
    model = make_gpt()
    opt = build([{"type": "SGD", "select": ["lm_head.*"], "params": {"lr": 0.1}}, ADAMW], model)
    assert opt.optimizers[0].param_groups[0]["params"] == [model.wte.weight]  # lm_head.weight is wte.weight


@pytest.mark.parametrize("sections, message", [
    ([MUON, {"type": "AdamW", "select": ["blocks.0.*"], "params": {}}], r"selected by several sections: blocks\.0\.attn"),
    ([MUON], r"no section selects: wte\.weight, wpe\.weight"),
    ([MUON, ADAMW, dict(ADAMW, type="SGD")], r"sections \[1, 2\] both select 'rest'"),
    ([MUON, {"type": "AdamW", "params": {}}], r"sections \[1\] have no 'select'"),
    ([MUON, ADAMW, {"type": "SGD", "select": ["nothing.*"], "params": {"lr": 0.1}}], r"select no trainable"),
])
def test_overlapping_uncovered_or_empty_selections_are_one_clear_error(sections, message):
    with pytest.raises(OptimizerError, match=message):
        build(sections, make_gpt())


def test_a_bad_selector_is_a_config_error():
    with pytest.raises(zerodp.ConfigError, match="select"):
        load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": [dict(MUON, select="vectors")]})


def test_sections_from_json_train_bitwise_like_the_same_optimizers_passed_as_a_list(tmp_path):
    """World size 1: the config's list builds what zerodp.initialize(model, [AdamW, MuonFP32]) gets, in
    that order, and trains bitwise alike (parity with plain PyTorch on several ranks is in
    tests/dist/test_optimizer_sections.py). MuonFP32 is named by the type its registration gives it."""
    from zerodp.tools.models.gpt import lm_loss

    register()
    muon = {"type": "MuonFP32", "select": "matrices", "params": {"lr": 0.02, "ns_coefficients": [1.5, -0.5, 0.0]}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": [ADAMW, muon]}))
    from_config = zerodp.initialize(make_gpt(), config=str(path))
    assert [type(o) for o in from_config.user_optimizer.optimizers] == [torch.optim.AdamW, MuonFP32]
    model = make_gpt()
    named = list(model.named_parameters())
    from_list = zerodp.initialize(model, [
        torch.optim.AdamW([p for n, p in named if not is_muon_param(n, p)], lr=1e-3),
        MuonFP32([p for n, p in named if is_muon_param(n, p)], lr=0.02, ns_coefficients=(1.5, -0.5, 0.0))],
        {"train_micro_batch_size_per_gpu": 2})
    for step in range(3):
        x = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(step))
        for engine in (from_config, from_list):
            engine.backward(lm_loss(engine(x[:, :-1]), x[:, 1:]))
            engine.step()
    init = make_gpt().state_dict()
    for (name, p), q in zip(from_config.module.named_parameters(), from_list.module.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
        assert not torch.equal(p.detach(), init[name]), f"{name} did not train"
