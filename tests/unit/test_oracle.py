"""The parity oracle (tests/oracle.py) is plain PyTorch, and its tolerances catch a wrong update."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.oracle import RankBuffers, assert_adam_params_close, assert_matches_reference, train_reference


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def test_the_reference_is_the_plain_loop_bitwise():
    def step_loss(model, step):
        x, y = _batch(step)
        return F.mse_loss(model(x), y)

    model = _net()
    ref = train_reference(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4, step_loss, clip=0.5)
    plain = _net()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(4):
        x, y = _batch(step)
        loss = F.mse_loss(plain(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert ref.losses == losses and ref.grad_norms == norms
    for key, value in plain.state_dict().items():
        assert torch.equal(ref.params[key], value), key


def test_accumulation_divides_each_micro_batch_and_records_the_mean():
    def micro_loss(model, step, micro):
        x, y = _batch(10 * step + micro)
        return F.mse_loss(model(x), y)

    model = _net()
    ref = train_reference(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, micro_loss, accumulation=2)
    plain = _net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(2):
        total = 0.0
        for micro in range(2):
            x, y = _batch(10 * step + micro)
            loss = F.mse_loss(plain(x), y)
            (loss / 2).backward()
            total += loss.item() / 2
        opt.step()
        opt.zero_grad()
        assert ref.losses[step] == total
    for key, value in plain.state_dict().items():
        assert torch.equal(ref.params[key], value), key


def test_a_backward_that_fails_skips_its_step_and_keeps_its_gradients():
    """`backward` returning False: no step, no zero_grad, no loss recorded; the next step adds to the gradients."""
    def backward(loss, step):
        loss.backward()
        return step != 1  # step 1's backward "raised" after it finished: its gradients stay

    def step_loss(model, step):
        x, y = _batch(step)
        return F.mse_loss(model(x), y)

    model = _net()
    ref = train_reference(model, [torch.optim.SGD(model.parameters(), lr=0.1)], 3, step_loss, backward=backward)
    plain = _net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = step_loss(plain, step)
        loss.backward()
        if step == 1:
            continue
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert ref.losses == losses and len(losses) == 2
    for key, value in plain.state_dict().items():
        assert torch.equal(ref.params[key], value), key


def test_rank_buffers_keep_each_ranks_batchnorm_statistics():
    """One forward per rank and micro-step, each with that rank's running statistics, equals the loop written out
    (loading and keeping each rank's buffers by hand), bitwise; and the two ranks' statistics differ."""
    def bn_net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def rows(step, chunk):  # chunk = micro * 2 + rank: 4 rows each
        x, y = _batch(step)
        return x[4 * chunk:4 * chunk + 4], y[4 * chunk:4 * chunk + 4]

    model = bn_net()
    buffers = RankBuffers(model, 2)

    def chunk_loss(model, step, chunk):
        x, y = rows(step, chunk)
        with buffers.of(model, chunk % 2):
            out = model(x)
        return F.mse_loss(out, y)

    ref = train_reference(model, torch.optim.SGD(model.parameters(), lr=0.1), 3, chunk_loss, accumulation=4)
    plain = bn_net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    own = [{k: v.clone() for k, v in plain.named_buffers()} for _ in range(2)]
    for step in range(3):
        for chunk in range(4):
            with torch.no_grad():
                for k, v in plain.named_buffers():
                    v.copy_(own[chunk % 2][k])
            x, y = rows(step, chunk)
            (F.mse_loss(plain(x), y) / 4).backward()
            own[chunk % 2] = {k: v.clone() for k, v in plain.named_buffers()}
        opt.step()
        opt.zero_grad()
    for key, value in plain.named_parameters():
        assert torch.equal(ref.params[key], value), key
    for rank in range(2):
        for key, value in own[rank].items():
            assert torch.equal(buffers.per_rank[rank][key], value), (rank, key)
    assert not torch.equal(buffers.per_rank[0]["1.running_mean"], buffers.per_rank[1]["1.running_mean"])


def test_the_tolerances_catch_a_wrong_update_of_1e_4():
    params = {"w": torch.full((4, 4), 0.5)}
    wrong = {"w": params["w"].clone()}
    wrong["w"][1, 2] += 1e-4
    assert_matches_reference(0, [1.0], params, [1.0], params)
    with pytest.raises(AssertionError, match="w differs"):
        assert_matches_reference(0, [1.0], wrong, [1.0], params)
    with pytest.raises(AssertionError, match="losses differ"):
        assert_matches_reference(0, [1.0 + 1e-4], params, [1.0], params)
    with pytest.raises(AssertionError, match="beyond 1e-3 of lr"):
        assert_adam_params_close(wrong, params, lr=1e-2, steps=3)


# -- one oracle: no test under tests/ trains a plain reference loop of its own --------------------------------------

TESTS = Path(__file__).resolve().parents[1]
# DeepSpeed's and DeepSpeed-Chat's own scripts, kept as their authors wrote them (engines named `model`)
NOT_SCANNED = ("oracle.py", "e2e/deepspeed_scripts/")

# Functions that step a plain optimizer after a backward and are not a parity reference, each with why. A new test that
# needs a single-process reference calls tests/oracle.py (extend it with what it lacks) instead of landing here.
OWN_LOOPS = {
    ("activation_regions.py", "train"): "one loop drives both sides of the activation-checkpointing tests (plain "
                                        "regions and each checkpointing form) and returns gradients and RNG state",
    ("e2e/accelerate_job.py", "main"): "a user's Accelerate loop; its reference is the same script's plain DDP run",
    ("hf/accelerate_worker.py", "run"): "a user's Accelerate loop; its reference is the same script without the plugin",
    ("dist/test_larc_formula.py", "larc_by_the_formula"):
        "LARC's formula written out independently of zerodp.optim.LARC, on purpose: it is what is checked",
    ("dist/test_ddp_bitwise.py", "ddp_vs_zerodp"):
        "the peer is torch's DistributedDataParallel on the same ranks, compared bitwise, not a one-process run",
    ("dist/test_dcp.py", "fsdp2_train"):
        "FSDP2 (a peer) trains on the ranks to write the checkpoint zerodp loads; the oracle continues from it",
    ("unit/adapters/test_deepspeed_engine_calls.py", "_adapter"): "one step that gives Adam its state; no comparison",
    ("unit/adapters/test_deepspeed_for_frameworks.py", "_adapter"): "one step that gives AdamW its state; no comparison",
    ("unit/engine/test_engine_errors.py", "test_optimizer_that_already_stepped"):
        "an optimizer that already has state, which initialize must refuse; no comparison",
    ("unit/tools/test_gpt_and_corpus.py", "test_tiny_gpt_learns_the_corpus"):
        "the bundled GPT's loss falls on the corpus; nothing is compared with zerodp",
    ("unit/test_oracle.py", "test_the_reference_is_the_plain_loop_bitwise"): "the oracle checked against the loop itself",
    ("unit/test_oracle.py", "test_accumulation_divides_each_micro_batch_and_records_the_mean"):
        "the oracle's accumulation checked against the loop itself",
    ("unit/test_oracle.py", "test_a_backward_that_fails_skips_its_step_and_keeps_its_gradients"):
        "the oracle's failed backward checked against the loop itself",
    ("unit/test_oracle.py", "test_rank_buffers_keep_each_ranks_batchnorm_statistics"):
        "the oracle's per-rank buffers checked against the loop itself",
}


def own_training_loops(source: str) -> list[str]:
    """The functions of `source` that call `.backward()` and `.step()` on something other than an engine (a name
    assigned from an `...initialize(...)` call, or named like an engine) or a schedule: a training loop of their own."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        engines = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and ast.unparse(node.value.func).endswith("initialize"):
                engines |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        stepped = {ast.unparse(c.func.value) for c in calls if c.func.attr == "step" and not c.args}
        stepped = {s for s in stepped if s not in engines and "engine" not in s and "sched" not in s}
        if stepped and any(c.func.attr == "backward" for c in calls):
            found.append(fn.name)
    return found


def test_the_scan_finds_a_reference_loop_and_passes_engine_loops():
    plain = ("def reference():\n    model = Net()\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "    for step in range(3):\n        loss(model, step).backward()\n        opt.step()\n        opt.zero_grad()\n")
    engine = ("def run():\n    again, *_ = deepspeed.initialize(model=m, config=c)\n    for step in range(3):\n"
              "        again.backward(loss(again, step))\n        again.step()\n        sched.step()\n"
              "def train(engine):\n    engine.backward(engine(x).sum())\n    engine.step()\n")
    assert own_training_loops(plain) == ["reference"]
    assert own_training_loops(engine) == []


def test_no_test_trains_a_reference_loop_of_its_own():
    """Every single-process reference under tests/ is tests/oracle.py's (its docstring says what is kept apart)."""
    found = set()
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        source = path.read_text()
        if not rel.startswith(NOT_SCANNED) and ".backward(" in source and ".step(" in source:  # parse only these
            found |= {(rel, name) for name in own_training_loops(source)}
    new = sorted(found - set(OWN_LOOPS))
    assert not new, (f"{new}: a training loop of its own (a .backward() and a plain optimizer's .step()); train the "
                     "reference with tests/oracle.py's train_reference (extend it with what it lacks), or, if it is not "
                     "a reference, add it to OWN_LOOPS with the reason")
    gone = sorted(set(OWN_LOOPS) - found)
    assert not gone, f"{gone}: in OWN_LOOPS but no longer a loop of its own: remove them from OWN_LOOPS"
