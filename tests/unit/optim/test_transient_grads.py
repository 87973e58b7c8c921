"""[Note: fp32 gradients at the step] (optim/transient_grads.py): with bf16 gradients and fp32 masters the
step's fp32 gradient copies exist one window of units at a time, counted in live tensor bytes, and the
windowed step gives bitwise the parameters of the step over every unit at once (the one it replaced)."""

import gc

import pytest
import torch
import torch.nn.functional as F

import zerodp
from zerodp.tools.models.gpt import GPT, GPTConfig
from zerodp.optim import optimizer as optimizer_module, transient_grads
from zerodp.optim.step_path import TransientGradients

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=8, n_head=4, n_embd=32)


def live_cpu_bytes() -> int:
    """Bytes of every distinct CPU storage a Python tensor object holds now."""
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: deprecated torch objects warn on it
            try:
                s = obj.untyped_storage()
            except Exception:  # a stage-3 parameter left by another engine refuses reads outside a gather
                continue
            if s.device.type == "cpu" and s.nbytes():
                storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def train(stage: int, steps: int, windowed: bool, monkeypatch, measure: bool = False):
    """Parameters after `steps` bf16 steps (clipping on), and the live bytes the last step added at its peak."""
    if not windowed:
        monkeypatch.setattr(optimizer_module, "transient_grads_apply", lambda opt: False)
    torch.manual_seed(0)
    model = GPT(CFG)
    zero = {"stage": stage, **({"stage3_unit_modules": ["Block"]} if stage == 3 else {"reduce_bucket_size": 20000})}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                               {"bf16": {"enabled": True}, "gradient_clipping": 0.05, "zero_optimization": zero})
    assert isinstance(engine.optimizer.path, TransientGradients) is windowed
    assert transient_grads.transient_grads_apply(engine.optimizer)  # the case applies; `windowed` chooses
    assert len(transient_grads.WindowedGradSteps(engine.optimizer)._windows()) > 2  # several windows, or the comparison proves nothing
    inner, peak = engine.optimizer.optimizer, [0]
    step = inner.step
    if measure:
        def counted_step(*args, **kwargs):  # the moment fp32 gradients are bound: the step's peak
            peak[0] = max(peak[0], live_cpu_bytes())
            return step(*args, **kwargs)
        inner.step = counted_step
    extra = 0
    for i in range(steps):
        x = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(i))
        loss = F.cross_entropy(engine(x[:, :-1]).float().reshape(-1, 256), x[:, 1:].reshape(-1))
        engine.backward(loss)
        gc.collect()
        before, peak[0] = live_cpu_bytes(), 0
        engine.step()
        extra = peak[0] - before
    params = {k: v.clone() for k, v in engine.full_state_dict().items()}
    numel = sum(m.numel() for m in engine.optimizer.masters)
    engine.close()
    return params, extra, numel


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_windowed_step_is_bitwise_the_whole_step(stage, monkeypatch):
    windowed, _, _ = train(stage, 3, True, monkeypatch)
    with monkeypatch.context() as m:
        whole, _, _ = train(stage, 3, False, m)
    assert windowed.keys() == whole.keys()
    for k in whole:
        assert torch.equal(windowed[k], whole[k]), k


@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_stage3_step_holds_fp32_gradients_of_one_window(monkeypatch):
    _, extra, numel = train(3, 2, True, monkeypatch, measure=True)
    # one Block of 8 (a window is at most max(largest unit, 1/8 of the shard)): 4 bytes x its elements
    assert 0 < extra <= 4 * numel / 6, extra / numel
    with monkeypatch.context() as m:
        _, whole_extra, _ = train(3, 2, False, m, measure=True)
    assert whole_extra >= 4 * numel  # what it replaced: an fp32 copy of every gradient at once
