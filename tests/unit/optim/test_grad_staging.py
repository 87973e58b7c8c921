"""ZeRO-Offload's gradients copied to the host as they are reduced (optim/grad_staging.py), run on the CPU by
forcing the host-step placement (as test_placement.py does): with gradient accumulation, fp16 loss scaling and
clipping, the step that reads the copies queued at the boundary's deliveries is bitwise the step in place. The
copies carry the shard's own dtype (bf16/fp16: 2 bytes per element) and are widened to fp32 on the host, in
place, in the one buffer per unit the step reads ([Note: 16-bit copies, widened on the host])."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import zerodp
import zerodp.engine.zero_engine as engine_module
from tests.dist.common import global_batch, make_model, make_optimizer
from zerodp.offload.placement import HOST, Home

STEPS, GAS = 3, 2


def _train(cfg: dict, forced: bool, counts: Optional[dict] = None):
    """STEPS optimizer steps of GAS micro-steps each; the final parameters and the staging's copy count.
    `counts`, if given, receives the staging's byte counts and the gradient shards' element count and dtype."""
    original = engine_module.placement_of
    if forced:  # the GPU's ZeRO-Offload placement, with the host as the "device" (copies change no value): its
        def forced_placement(config, device):  # staging homes are the shards' and the parameters' dtypes
            p = original(config, device)
            return dataclasses.replace(p, masters_are_shards=False, grad_staging=Home(HOST, p.grads.dtype),
                                       param_staging=Home(HOST, p.compute.dtype))
        engine_module.placement_of = forced_placement
    try:
        model = make_model()
        with zerodp.initialize(model, make_optimizer("adamw", model), cfg) as engine:
            for step in range(STEPS):
                for micro in range(GAS):
                    x, y = global_batch(step * GAS + micro, 4)
                    engine.backward(F.mse_loss(engine(x).float(), y))
                    engine.step()
            staging = engine.optimizer.plan.staging
            copies = (staging.staged_copies if staging is not None else 0, len(engine.units))
            if counts is not None:
                counts.update(copied_bytes=staging.copied_bytes, grad_staging_bytes=staging.nbytes(),
                              staging_bytes=engine.optimizer.plan.staging_bytes(),
                              shard_numel=sum(u.grad_shard.numel() for u in engine.units),
                              shard_dtypes={u.grad_shard.dtype for u in engine.units})
            return engine.full_state_dict(), copies
    finally:
        engine_module.placement_of = original


@pytest.mark.parametrize("offload", [None, "nvme"])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_staged_at_their_last_reduction_step_bitwise_as_in_place(stage, precision, offload, tmp_path):
    zero = {"stage": stage}
    if offload:  # the optimizer state streamed through files (the same host step, in windows)
        zero["offload_optimizer"] = {"device": offload, "nvme_path": str(tmp_path)}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.05,
           "zero_optimization": zero}
    if precision != "fp32":
        cfg[precision] = {"enabled": True, **({"initial_scale_power": 4} if precision == "fp16" else {})}
    plain, _ = _train(cfg, forced=False)
    staged, (copies, _) = _train(cfg, forced=True)
    assert copies >= STEPS  # the step read copies queued at deliveries (a stage-3 unit untouched: copied at the step)
    for key in plain:
        assert torch.equal(plain[key], staged[key]), key
    fresh = make_model().state_dict()
    assert not torch.equal(fresh["hidden.weight"], plain["hidden.weight"].to(fresh["hidden.weight"].dtype))


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_only_the_boundary_deliveries_are_staged_in_the_shards_dtype(precision):
    """Stage 2 reduces every bucket at every micro-step; only the boundary's reductions are the step's: one copy
    per bucket per step, not one per micro-step. Each copy carries the shard's own dtype (2 bytes per element in
    bf16/fp16, not an fp32 conversion), and the pinned bytes stay one fp32 buffer per unit (4 per element, what
    they were when the copies were fp32): the copy lands inside the buffer the step reads, no scratch beside it."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "zero_optimization": {"stage": 2}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    counts: dict = {}
    _, (copies, units) = _train(cfg, forced=True, counts=counts)
    assert copies == STEPS * units
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    assert counts["shard_dtypes"] == {dtype}
    numel = counts["shard_numel"]
    assert counts["copied_bytes"] == STEPS * numel * dtype.itemsize  # 2 bytes per element over the bus in 16-bit
    assert counts["grad_staging_bytes"] == 4 * numel  # pinned: one fp32 buffer per unit
    assert counts["staging_bytes"] == (4 + dtype.itemsize) * numel  # and the parameters' write-back buffer


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_loss_scale_divides_the_widened_copy(stage):
    """A static loss scale that is not a power of two: the division rounds, and must round in fp32 after the
    widening, as the step in place divides the shard cast to fp32 (a division of the fp16 copy would differ)."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.05,
           "fp16": {"enabled": True, "loss_scale": 12.0}, "zero_optimization": {"stage": stage}}
    plain, _ = _train(cfg, forced=False)
    staged, (copies, _) = _train(cfg, forced=True)
    assert copies >= STEPS
    for key in plain:
        assert torch.equal(plain[key], staged[key]), key


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("precision,accum", [("bf16", "fp32"), ("fp32", "bf16")])
def test_a_configured_accumulation_dtype_is_what_the_copies_carry(stage, precision, accum):
    """data_types.grad_accum_dtype sets the shards' dtype, and with it the copies' (placement.py): fp32 shards of a
    bf16 model are copied as they are (no widening), bf16 shards of an fp32 model widened; bitwise either way."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.05,
           "data_types": {"grad_accum_dtype": accum}, "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    plain, _ = _train(cfg, forced=False)
    counts: dict = {}
    staged, _ = _train(cfg, forced=True, counts=counts)
    assert counts["shard_dtypes"] == {torch.float32 if accum == "fp32" else torch.bfloat16}
    for key in plain:
        assert torch.equal(plain[key], staged[key]), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [0, 1, 2, 7, 64, 1000])
def test_a_16_bit_copy_widens_in_place_exactly(dtype, numel, monkeypatch):
    """`widen_in_place` over its blocks (a tail of 2 elements here, so that small buffers take many blocks) gives
    every element's exact fp32 value, subnormals, infinities and NaN included, in the buffer it landed in."""
    from zerodp.optim import grad_staging

    monkeypatch.setattr(grad_staging, "WIDEN_TAIL_NUMEL", 2)
    gen = torch.Generator().manual_seed(numel)
    values = (torch.randn(numel, generator=gen) * 4.0 ** torch.randint(-12, 8, (numel,), generator=gen)).to(dtype)
    tiny, big = torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).max  # a subnormal, the lowest finite value
    special = torch.tensor([tiny, big, float("inf"), float("nan")], dtype=dtype)
    values[:4] = special[:min(4, numel)]
    buf = torch.full((numel,), 7.0)
    landing = grad_staging.landing_view(buf, dtype)
    assert landing.dtype == dtype and landing.numel() == numel
    assert landing.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # no second buffer
    landing.copy_(values)
    grad_staging.widen_in_place(buf, landing)
    torch.testing.assert_close(buf, values.float(), rtol=0, atol=0, equal_nan=True)  # exact: every value is fp32


class _Shared(torch.nn.Module):
    """One weight used in two re-entrant checkpointed regions: its second gradient arrives after its bucket's
    reduction (a late gradient, a second round whose delivery must be copied again)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(12, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 5)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.out(h)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_late_gradients_second_round_is_copied_again(stage):
    original = engine_module.placement_of
    results = []
    for forced in (False, True):
        if forced:
            engine_module.placement_of = lambda config, device: dataclasses.replace(
                original(config, device), masters_are_shards=False, grad_staging=Home(HOST, torch.float32),
                param_staging=Home(HOST, torch.float32))
        try:
            model = _Shared()
            zero = {"stage": stage, **({"reduce_bucket_size": 1} if stage < 3 else {})}  # a bucket per parameter
            cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.05, "zero_optimization": zero}
            with zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg) as engine:
                for step in range(STEPS):
                    x, y = global_batch(step, 4)
                    engine.backward(F.mse_loss(engine(x.requires_grad_()), y))
                    rounds = max(u.grads.rounds_launched for u in engine.units)
                    engine.step()
                staging = engine.optimizer.plan.staging
                results.append((engine.full_state_dict(), staging.staged_copies if staging else 0, rounds,
                                len(engine.units)))
        finally:
            engine_module.placement_of = original
    (plain, _, _, _), (staged, copies, rounds, units) = results
    if stage < 3:  # stage 3 reduced this model in one round (its parity is checked all the same)
        assert rounds == 2 and copies > STEPS * units  # a second round, delivered and copied again
    for key in plain:
        assert torch.equal(plain[key], staged[key]), key


@pytest.mark.parametrize("offload", [None, "offload_optimizer", "offload_param"])
def test_the_clip_norm_reads_the_16_bit_shards_on_every_path(offload, tmp_path, monkeypatch):
    """bf16 without loss scaling: whatever walks the step (the transient windows, the offloaded state's windows,
    offload_param's units; a GPU's host step), the global norm is taken from the gradient shards as reduced, never
    from fp32 copies of them. One value on every path, on a GPU too, whose reduction of a bf16 input need not sum
    in the order of its fp32 copy's: tests/gpu/test_cuda_offload.py compares offload_param with no offload bitwise,
    with the clip active."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}  # sharded units: offload_param moves them
    if offload:
        zero[offload] = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.05, "bf16": {"enabled": True},
           "zero_optimization": zero}
    model = make_model()
    with zerodp.initialize(model, make_optimizer("adamw", model), cfg) as engine:
        x, y = global_batch(0, 4)
        engine.backward(F.mse_loss(engine(x).float(), y))
        assert (offload == "offload_param") == any(unit.param_offloaded for unit in engine.units)
        normed, vector_norm = [], torch.linalg.vector_norm

        def recording(t, *args, **kwargs):
            normed.append(t.dtype)
            return vector_norm(t, *args, **kwargs)
        monkeypatch.setattr(torch.linalg, "vector_norm", recording)
        engine.step()
        monkeypatch.undo()
    assert normed and set(normed) == {torch.bfloat16}, normed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cuda_copies_are_ordered_by_streams_and_events(dtype, monkeypatch):
    """The CUDA branch of GradStaging, which the CPU never takes, run with fake streams and events that log what
    would be ordered after what: each delivery's copy waits for the compute stream and runs on the side stream; a
    second delivery into the shard waits for the copy in flight; the host reads only after both streams; the
    shards are zeroed (after `settle`) only after the side stream. Every copy from a shard carries the shard's
    dtype; a 16-bit one is widened on the host after the waits."""
    log, active, carried = [], [], []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other) -> None:
            log.append(f"{self.name} waits {other.name}")

        def wait_event(self, event) -> None:
            log.append(f"{self.name} waits {event.name}")

        def synchronize(self) -> None:
            log.append(f"host waits {self.name}")

    class Event:
        def __init__(self) -> None:
            self.name = "event"

        def record(self, stream) -> None:
            log.append(f"event on {stream.name}")

    class StreamContext:
        def __init__(self, stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            active.append(self.stream)

        def __exit__(self, *exc) -> None:
            active.pop()

    compute = Stream("compute")
    copy = torch.Tensor.copy_

    def logged_copy(dst, src, non_blocking=False):
        if any(src is s for s in shards):  # from the "device"
            log.append(f"copy on {(active or [compute])[-1].name}")
            carried.append(dst.dtype)
        else:
            log.append("widen on host")
        return copy(dst, src, non_blocking)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("side"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: (active or [compute])[-1])
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    from zerodp.optim.grad_staging import GradStaging

    staging = GradStaging(Home(HOST, dtype), torch.device("cuda", 0), torch.float32)
    shards = shard, untouched = torch.arange(4.0).to(dtype), torch.ones(3, dtype=dtype)
    staging.arm(True)
    staging.before_write(0)             # the first round's wait(): nothing in flight
    staging.after_write(0, shard)       # its delivery
    staging.before_write(0)             # a late gradient's second round: its wait() ...
    shard.add_(1.0)                     # ... then its delivery adds into the shard
    staging.after_write(0, shard)
    took = staging.take(0, shard)       # the copy of the last delivery; a unit not delivered is copied now:
    staging.take(1, untouched)
    staging.wait()
    staging.settle()
    assert log == ["side waits compute", "copy on side", "event on side",
                   "compute waits event",
                   "side waits compute", "copy on side", "event on side",
                   "copy on compute",
                   "host waits side", "host waits compute",
                   *(["widen on host"] * 2 if dtype != torch.float32 else []),
                   "compute waits side"]
    assert carried == [dtype] * 3
    assert took.dtype == torch.float32 and torch.equal(took, shard.float()) and staging.staged_copies == 2


def test_updated_parameters_go_back_to_the_gpu_without_a_host_wait(monkeypatch):
    """The host step's write-back (step_plan.py `_copy_to_device`), whose CUDA branch the CPU never takes, run with
    a fake event: the copy from the pinned buffer is queued non-blocking, and the next step writes that buffer only
    after waiting for the event of the copy that read it (no other wait)."""
    log = []

    class Event:
        def record(self, stream) -> None:
            log.append(f"event on {stream}")

        def synchronize(self) -> None:
            log.append("host waits event")

    copy = torch.Tensor.copy_

    def logged_copy(dst, src, non_blocking=False):
        log.append(f"copy non_blocking={non_blocking}")
        return copy(dst, src, non_blocking)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    from zerodp.optim.grad_staging import HostBuffers
    from zerodp.optim.step_plan import StepPlan

    plan = StepPlan.__new__(StepPlan)  # only the write-back's state: the rest of a plan is not read here
    plan._param_staging, plan._param_copies = HostBuffers(Home(HOST, torch.bfloat16, pinned=False)), {}
    shard, master = torch.zeros(4, dtype=torch.bfloat16), torch.arange(4.0)
    for step in range(2):
        plan._copy_to_device(0, shard, plan._param_staged(0, master + step))
    assert log == ["copy non_blocking=False",                    # the cast into the staging buffer (host)
                   "copy non_blocking=True", "event on compute",  # queued on the compute stream
                   "host waits event",                          # the next step, before it writes the buffer
                   "copy non_blocking=False", "copy non_blocking=True", "event on compute"]
    assert torch.equal(shard, (master + 1).to(torch.bfloat16))
