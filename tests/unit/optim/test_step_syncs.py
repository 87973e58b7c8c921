"""Host reads of tensor values during a training step (issue 32: the step is host-bound on a GPU, and every
read of a device value is a sync that stalls the host's run-ahead). Counted on the CPU over one bf16
micro-step and optimizer step with clipping (bf16, fp32, fp16), world size 1: `.item()`, `.tolist()`, `float/int/bool(t)`,
`.numpy()` and `.cpu()` of any tensor, except reads of what lives on the host by design on a GPU run too
(the received flags the control collective returns, torch's per-parameter `step` counters), which cost no
sync. What must remain: one, whether the global norm is finite (optim/optimizer.py `step`: the `nonfinite`
policy must know before the first write), or in fp16 the overflow vote (one flag for all units). The clip coefficient stays on the device (torch's
clip_grad_norm_ rule), the norm is read only when someone asks for `engine.grad_norm`, and one rank asks
nobody about its reduction rounds (grads/reduce_queue.py [Note: the control collective's one read])."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import zerodp
from tests.dist.common import global_batch, make_model, make_optimizer

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"}


def _tensors(value) -> list[torch.Tensor]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


class HostReads(TorchFunctionMode):
    """Records each host read of a device value, (what, where in zerodp). A tensor is on the host by design
    (no sync to read it on a GPU run either) when it was made from Python data (`torch.tensor`), or by a
    factory given no device, or computed from such tensors only; a `.to(device)` result is a device value
    (on a GPU run it is on the GPU), and `.cpu()` always counts (it is the copy a sync waits for)."""

    def __init__(self, host: list[torch.Tensor]) -> None:
        super().__init__()
        self.host = {id(t) for t in host}  # by identity: the tensors are kept alive (self.seen), ids not reused
        self.seen: list[torch.Tensor] = list(host)
        self.reads: list[tuple[str, str]] = []

    def _mark(self, tensors: list[torch.Tensor], host: bool) -> None:
        self.seen += tensors
        for t in tensors:
            self.host.add(id(t)) if host else self.host.discard(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [id(t) for a in list(args) + list(kwargs.values()) for t in _tensors(a)]
        if name in READS and args and isinstance(args[0], torch.Tensor):
            if name == "cpu" or id(args[0]) not in self.host:
                frames = [f for f in traceback.extract_stack()[:-1] if "/zerodp/" in f.filename]
                self.reads.append((name, f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} "
                                         f"{frames[-1].name}" if frames else "?"))
        out = func(*args, **kwargs)
        if name in READS:
            self._mark(_tensors(out), host=name == "cpu")  # a copy on the host: reading it costs nothing more
            return out
        if name == "to":  # on the CPU `.to(cpu)` may return its input: what a GPU run would move is a device value
            self._mark(_tensors(out), host=False)
            return out
        if inputs:
            host = all(p in self.host for p in inputs)
        else:  # a factory
            host = name == "tensor" or kwargs.get("device") is None
        self._mark(_tensors(out), host)
        return out


@pytest.mark.parametrize("precision", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_reads_one_device_value(stage, precision):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.05, "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    model = make_model()
    with zerodp.initialize(model, make_optimizer("adamw", model), cfg) as engine:
        x, y = global_batch(0, 4)
        engine.backward(F.mse_loss(engine(x).float(), y))
        engine.step()  # the first step creates the optimizer state: count the second
        x, y = global_batch(1, 4)
        loss = F.mse_loss(engine(x).float(), y)
        steps = [state["step"] for state in engine.optimizer.optimizer.state.values()
                 if torch.is_tensor(state.get("step"))]  # torch's step counters: CPU tensors on a GPU run too
        with HostReads(steps) as mode:
            engine.backward(loss)
            engine.step()
        device_reads = mode.reads
        assert len(device_reads) == 1, device_reads
        # bf16/fp32: whether the norm is finite (nonfinite policy); fp16: the overflow vote, which implies it
        expected = ("item", "collectives.py") if precision == "fp16" else ("__bool__", "optimizer.py")
        assert device_reads[0][0] == expected[0] and expected[1] in device_reads[0][1], device_reads
        assert isinstance(engine.grad_norm, float) and engine.grad_norm > 0  # still a float for whoever asks


@pytest.mark.parametrize("backend,expected", [("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cpu"), ("gloo", "cpu"),
                                              ("cpu:gloo, cuda:nccl", "cpu")])
def test_the_control_flags_stay_on_the_host_where_the_group_reduces_cpu_tensors(monkeypatch, backend, expected):
    """A group that reduces CPU tensors agrees on the host: no wait for the GPU's backward (a device value)."""
    from zerodp import comm
    from zerodp.shard.grads.reduce_queue import control_device

    monkeypatch.setattr(comm, "backend_name", lambda group=None: backend)
    assert control_device(None, torch.device("cuda", 0)).type == expected


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_with_a_late_parameter_reads_one_device_value(stage, precision):
    """A step in which a parameter that missed the first one is stepped with its own count (optim/step_counts.py):
    which parameters are late is known from host lists, and its temporary optimizer's `step` is made from a Python
    int, as torch keeps it (a CPU tensor): still the one read of the norm's finiteness."""
    from tests.unit.optim.test_step_counts import Branch

    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.05, "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    model = Branch()
    with zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg) as engine:
        dtype = next(model.parameters()).dtype
        x, y = torch.randn(3, 5).to(dtype), torch.randn(3, 7)
        engine.backward(F.mse_loss(engine(x, False).float(), y))
        engine.step()  # b gets no gradient: it is late at the next step
        late = engine.optimizer.step_counts.late(None)
        assert late, "b should be stepped with its own count at the next step"
        loss = F.mse_loss(engine(x, True).float(), y)
        steps = [state["step"] for state in engine.optimizer.optimizer.state.values()
                 if torch.is_tensor(state.get("step"))]
        with HostReads(steps) as mode:
            engine.backward(loss)
            engine.step()
        assert len(mode.reads) == 1, mode.reads
        assert mode.reads[0][0] == "__bool__" and "optimizer.py" in mode.reads[0][1], mode.reads
