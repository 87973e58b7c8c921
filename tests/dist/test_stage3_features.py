"""Stage 3 beyond parity: what it moves (3Ψ per step: each unit gathered once in forward, once in
backward, its gradients reduce-scattered once), how much it gathers at once (within the configured
budget), what it holds (16Ψ/N), inference, and the user-facing contract of partitioned parameters
(clear errors, `gathered_parameters` reads and writes)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from zerodp import comm
from zerodp.tools.models.gpt import GPT, GPTConfig, lm_loss
from tests.dist.test_stage3_parity import BatchNormNet, FrozenEmbedNet, float_batch, pooled_batch


@pytest.fixture(scope="module", params=[3, 2, 1, 4])
def world(request):
    """Module-scoped, so pytest runs every test of one world size together and reuses its workers.
    Tests pick their sizes with indirect parametrization."""
    return request.param


def gpt(n_layer: int = 3) -> GPT:
    return GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=n_layer, n_head=2, n_embd=10), seed=5)


def tokens(step: int, rows: int = 2):
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, 29, (rows, 7), generator=g)
    return ids[:, :-1], ids[:, 1:]


def gathered_bytes(engine) -> int:
    """Bytes of gathered (full) parameter storage allocated now, read from the buffers themselves."""
    return sum(f.gathered.nbytes for f in engine.sharding.flats if not f.persistent)


# -- traffic and working set ----------------------------------------------------------------------


def traffic_run() -> dict:
    model = gpt()
    cfg = {"zero_optimization": {"stage": 3, "stage3_unit_modules": ["Block"],
                                 "stage3_param_persistence_threshold": 0}}
    probe_model = gpt()  # an engine built only to read unit sizes, to set the budgets
    probe = zerodp.initialize(probe_model, torch.optim.SGD(probe_model.parameters(), lr=0.1), cfg)
    flats_numel = [f.layout.padded_numel for f in probe.sharding.flats]
    root_numel = [f.layout.padded_numel for f in probe.sharding.flats if f.module_name == "<root>"]
    last_block = probe.sharding.module_units[-1].name  # the last unit to start its forward
    last_numel = [f.layout.padded_numel for f in probe.sharding.flats if f.module_name == last_block]
    per_unit = {mu.name: mu.gathered_numel for mu in probe.sharding.module_units}
    block = per_unit["blocks.0"]
    root_and_block = per_unit["<root>"] + block
    # room for the root, the running block and one prefetched block: prefetch must stop there
    budget = root_and_block + block
    cfg["zero_optimization"].update(stage3_max_live_parameters=budget, stage3_prefetch_bucket_size=10 * block)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)
    observed = []
    for m in model.modules():  # an independent look at the working set, from the storage sizes
        m.register_forward_pre_hook(lambda *_: observed.append(gathered_bytes(engine)))
        m.register_forward_hook(lambda *_: observed.append(gathered_bytes(engine)))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: observed.append(gathered_bytes(engine)))
    logs = {}
    for step in range(3):  # step 0 records the order; steps 1-2 prefetch
        x, y = tokens(step)
        engine.sharding.reset_peak()
        with comm.record() as fwd:
            loss = lm_loss(engine(x), y)
        with comm.record() as bwd:
            engine.backward(loss)
        with comm.record() as opt:
            engine.step()
        logs[step] = {"fwd": [r.numel for r in fwd.of("all_gather", "param")],
                      "bwd": [r.numel for r in bwd.of("all_gather", "param")],
                      "rs": [r.numel for r in bwd.of("reduce_scatter", "grad")],
                      "step_gathers": len(opt.of("all_gather")),
                      "peak": engine.sharding.peak_live_numel}
    return {"flats": flats_numel, "root": root_numel, "last": last_numel, "budget": budget, "root_and_block": root_and_block, "logs": logs,
            "observed_peak_bytes": max(observed), "live_after": engine.sharding.live_numel}


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_each_unit_moves_three_psi_per_step_within_the_budget(dist_run, world):
    for r in dist_run(world, traffic_run):
        units = collections.Counter(r["flats"])
        # the root's units stay gathered from their forward to their backward (as FSDP's root does)
        below_root = units - collections.Counter(r["root"])
        assert r["root"] and sum(below_root.values()) == len(r["flats"]) - len(r["root"])
        for step, log in r["logs"].items():
            # every flat unit exactly once per pass (a unit's numel identifies it up to equal sizes)
            assert collections.Counter(log["fwd"]) == units, f"step {step}: forward gathers {log['fwd']}"
            # from step 1 the unit whose forward started last also stays gathered into its backward
            kept = collections.Counter(r["last"]) if step > 0 else collections.Counter()
            assert r["last"] and collections.Counter(log["bwd"]) == below_root - kept, \
                f"step {step}: backward gathers {log['bwd']}"
            assert collections.Counter(log["rs"]) == units, f"step {step}: reductions {log['rs']}"
            assert log["step_gathers"] == 0, "no persistent unit, so nothing is gathered after the step"
            psi = sum(r["flats"])
            # the paper's 3Ψ, less one gather of the root's parameters (and of the last unit's)
            assert sum(log["fwd"]) + sum(log["bwd"]) + sum(log["rs"]) == 3 * psi - sum(r["root"]) - sum(kept.elements())
            assert log["peak"] <= r["budget"]
        # prefetch really happened (more than root + running block alive) and stayed in budget
        assert r["logs"][2]["peak"] > r["root_and_block"]
        assert r["observed_peak_bytes"] <= 4 * r["budget"]
        assert r["live_after"] == 0


# -- memory -----------------------------------------------------------------------------------------


def memory_run(precision: str, threshold: int) -> dict:
    model = gpt()
    cfg = {"zero_optimization": {"stage": 3, "stage3_unit_modules": ["Block"],
                                 "stage3_param_persistence_threshold": threshold}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    x, y = tokens(0)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    persistent = sum(f.layout.numel for f in engine.units if f.persistent)
    return {"report": engine.memory_report().as_dict(), "persistent_numel": persistent}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2, 3, 4], indirect=True)
def test_memory_is_sixteen_psi_over_n(dist_run, world, precision):
    elem = 2 if precision == "bf16" else 4
    k = (4 if precision == "bf16" else 0) + 8  # fp32 master when separate, Adam's two moments
    for r in dist_run(world, memory_run, precision, 0):
        rep = r["report"]
        psi, pad = rep["numel"], rep["padding_numel"]
        assert r["persistent_numel"] == 0
        for kind, per_elem in (("params", elem), ("grads", elem), ("optimizer", k)):
            predicted = per_elem * psi / world  # the paper's Pos+g+p: everything divided by N
            assert rep[f"{kind}_bytes_predicted"] == pytest.approx(predicted)
            assert abs(rep[f"{kind}_bytes"] - predicted) <= 0.01 * predicted + pad * per_elem / world + per_elem, kind
        total = sum(rep[f"{kind}_bytes"] for kind in ("params", "grads", "optimizer"))
        assert total == pytest.approx((2 * elem + k) * psi / world, rel=0.01, abs=(2 * elem + k) * (pad + 1))
    # persistent parameters (kept whole) cost exactly their full size on every rank, on top of 1/N
    for r in dist_run(world, memory_run, precision, 20):
        rep = r["report"]
        extra = r["persistent_numel"] * elem * (1 - 1 / world)
        assert r["persistent_numel"] > 0
        assert abs(rep["params_bytes"] - (rep["params_bytes_predicted"] + extra)) <= \
            rep["padding_numel"] * elem + 0.01 * rep["params_bytes_predicted"]


# -- inference --------------------------------------------------------------------------------------


def inference_run() -> dict:
    model = gpt()
    reference = gpt()  # same seed: the unsharded model
    cfg = {"zero_optimization": {"stage": 3, "stage3_unit_modules": ["Block"],
                                 "stage3_param_persistence_threshold": 11}}
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    engine.eval()
    reference.eval()
    x, _ = tokens(1, rows=3)
    out = {}
    with torch.no_grad():
        out["logits"] = (engine(x), reference(x))
        out["generated"] = (model.generate(x[:, :3], 4, temperature=0), reference.generate(x[:, :3], 4, temperature=0))
    out["grad_mode_eval"] = (engine(x).detach(), reference(x).detach())  # eval without no_grad, no backward
    torch.manual_seed(1)
    bn = BatchNormNet()
    bn_ref = BatchNormNet()
    bn_ref.load_state_dict(bn.state_dict())
    bn.train()(float_batch(1, 8)[0])  # non-trivial running statistics, the same on every rank
    bn_ref.train()(float_batch(1, 8)[0])
    bn_engine = zerodp.initialize(bn, torch.optim.SGD(bn.parameters(), lr=0.1),
                                  {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    bn_engine.eval()
    bn_ref.eval()
    xb, _ = float_batch(0, 4)
    with torch.no_grad():
        out["batchnorm"] = (bn_engine(xb), bn_ref(xb))
    # units gathered by the no_grad eval forwards stay gathered for the next ones (stage3/inference_cache.py)
    out["live"] = engine.sharding.live_numel + bn_engine.sharding.live_numel
    engine.train()
    bn_engine.train()
    out["live_after_train"] = engine.sharding.live_numel + bn_engine.sharding.live_numel
    return out


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_inference_equals_unsharded_model(dist_run, world):
    for r in dist_run(world, inference_run):
        for key in ("logits", "generated", "grad_mode_eval", "batchnorm"):
            got, ref = r[key]
            assert torch.equal(got, ref), key
        assert r["live"] > 0, "inference forwards keep their units gathered"
        assert r["live_after_train"] == 0, "train() releases every kept unit"


# -- the contract of partitioned parameters --------------------------------------------------------


def contract_run() -> dict:
    model = gpt(n_layer=2)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "zero_optimization": {"stage": 3, "stage3_unit_modules": ["Block"], "stage3_param_persistence_threshold": 0}})
    w = model.blocks[1].mlp.fc.weight
    out = {"shape": tuple(w.shape), "numel": w.numel(), "requires_grad": w.requires_grad, "repr": repr(w),
           "count": sum(p.numel() for p in model.parameters())}
    errors = {}
    for what, fn in {"sum": lambda: w.sum(), "matmul": lambda: torch.ones(40) @ w,
                     "state_dict": lambda: model.state_dict(), "clone": lambda: w.clone()}.items():
        try:
            fn()
            errors[what] = None
        except zerodp.PartitionedParameterError as e:
            errors[what] = str(e)
    out["errors"] = errors
    x, y = tokens(0)
    try:
        lm_loss(engine(x), y).backward()  # not engine.backward
        out["plain_backward"] = None
    except RuntimeError as e:
        out["plain_backward"] = str(e)
    return out


@pytest.mark.parametrize("world", [2], indirect=True)
def test_partitioned_parameters_keep_shape_and_fail_clearly(dist_run, world):
    for r in dist_run(world, contract_run):
        assert r["shape"] == (40, 10) and r["numel"] == 400 and r["requires_grad"]
        assert r["count"] == gpt(n_layer=2).num_parameters()  # no torch.Size([0]) anywhere
        assert "gathered_parameters" in r["repr"]
        for what, message in r["errors"].items():
            assert message is not None, f"{what} on a partitioned parameter must raise"
            assert "zerodp.gathered_parameters" in message, message
        assert "blocks.1.mlp.fc.weight" in r["errors"]["sum"]
        assert "engine.backward(loss)" in r["plain_backward"]


def modify_run(bf16: bool) -> dict:
    """Rank 0 rewrites a weight through gathered_parameters(modifier_rank=0); the others scribble on
    theirs (ignored). Then a zero-lr step: under bf16 it copies the fp32 masters back into the model,
    so the new value survives only if the masters were updated too."""
    rank = dist.get_rank()
    model = FrozenEmbedNet()
    cfg = {"zero_optimization": {"stage": 3, "stage3_unit_modules": ["Embedding", "Layer"],
                                 "stage3_param_persistence_threshold": 0}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
    targets = {"trainable": model.layers[0].fc.weight, "frozen": model.embed.weight}
    with zerodp.gathered_parameters(targets.values(), modifier_rank=0):
        for i, p in enumerate(targets.values()):
            with torch.no_grad():
                p.fill_(0.25 * (i + 1) if rank == 0 else 7.0)
    x, y = pooled_batch(0, 2)
    engine.backward(F.mse_loss(engine(x).float(), y))
    engine.step()
    with zerodp.gathered_parameters(targets.values()):
        values = {k: p.detach().float().clone() for k, p in targets.items()}
    frozen_units = engine.sharding.frozen_units
    return {"values": values, "frozen_grad_bytes": sum(f.grad_bytes() for f in frozen_units),
            "frozen_shard": [f.param_shard.numel() for f in frozen_units],
            "frozen_numel": [f.layout.numel for f in frozen_units]}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_gathered_parameters_writes_reach_shards_and_masters(dist_run, world, bf16):
    for r in dist_run(world, modify_run, bf16):
        assert torch.all(r["values"]["trainable"] == 0.25)
        assert torch.all(r["values"]["frozen"] == 0.5)
        assert r["frozen_grad_bytes"] == 0  # frozen parameters: sharded, and no gradient memory
        assert all(s * world < n + world for s, n in zip(r["frozen_shard"], r["frozen_numel"]))
