"""[Note: one step count per parameter] (optim/step_counts.py): with AdamW, a parameter that misses steps (a branch
not taken) and later gets a gradient is updated as torch.optim.AdamW updates it, bias-corrected with its own step
count, not its flat chunk's. A model whose branches start late (first gradient at steps 1 and 2) and skip steps in
the middle is trained at world 2 and compared with plain PyTorch on the global batch in the same test: stages 0-3
in fp32, bf16 (the windowed fp32 gradient copies, optim/transient_grads.py), offload_optimizer cpu (streamed
windows), and a checkpoint saved while a branch lags, resumed bitwise, at another world size and stage, and from
a checkpoint written before counts were saved. Before this, these runs differed from torch's by ~lr/4 per element
of the late branches (a first update with chunk count 3 is 0.74 of torch's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.optim.step_path import TransientGradients
from tests.oracle import train_reference
from tests.dist.common import (HID, IN, OUT, assert_matches_reference, assert_trained, global_batch,
                               mixed_precision_reference, optimizer_chunks, param_groups)

# Which branches each step takes: b first at step 1, c first at step 2; b skips step 3, c skips step 4.
PATHS = ["", "b", "bc", "c", "b", "bc", "bc"]
STEPS, ROWS, CLIP, LR, WD = len(PATHS), 6, 1.0, 2e-2, 0.1  # ROWS: the global batch, split at worlds 2 and 3
CHUNK = 53  # optimizer chunks cut across parameters and shards (tests/dist/common.py optimizer_chunks)
SAVE_AT = 4  # a checkpoint after steps 0-3: b has missed step 3, so its count lags its chunk's


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(IN, HID), nn.Linear(HID, HID), nn.Linear(HID, HID)
        self.out = nn.Linear(HID, OUT)
        self.path = ""  # the mixed-precision reference calls model(x): the path is set beside it

    def forward(self, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        for name in self.path if path is None else path:
            h = torch.tanh(getattr(self, name)(h))
        return self.out(h)


def adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, WD), lr=LR)


def config(stage: int, bf16: bool = False, offload: bool = False) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200,
            "stage3_param_persistence_threshold": 30, "stage3_unit_min_params": 200}
    if stage == 3:  # bucket sizes do not apply at stage 3 (and warn)
        del zero["reduce_bucket_size"], zero["allgather_bucket_size"]
    if offload:  # small windows: the host step streams the state through several
        zero.update(offload_optimizer={"device": "cpu"}, sub_group_size=40)
    cfg = {"train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(), "gradient_clipping": CLIP,
           "zero_optimization": zero}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def reference(steps: int = STEPS) -> tuple[list[float], dict, dict]:
    """Plain torch.optim.AdamW, one process, the global batch: losses, final and initial parameters."""
    def step_loss(model: nn.Module, step: int) -> torch.Tensor:
        x, y = global_batch(step, ROWS)
        return F.mse_loss(model(x, PATHS[step]), y)

    model = Branches()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ref = train_reference(model, adamw(model), steps, step_loss, clip=CLIP)
    return ref.losses, ref.params, init


def train(engine, first: int, steps: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, first + steps):
        x, y = global_batch(step, ROWS)  # this rank's rows of the global batch
        rows = ROWS // world
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        x = x.to(next(engine.module.parameters()).dtype)
        loss = F.mse_loss(engine(x, PATHS[step]).float(), y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def params_of(engine) -> dict:
    with zerodp.gathered_parameters(engine.module.parameters()):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def run(stage: int, bf16: bool = False, offload: bool = False) -> tuple[list[float], dict]:
    with optimizer_chunks(CHUNK):
        model = Branches()
        engine = zerodp.initialize(model, adamw(model), config(stage, bf16, offload))
        assert not offload or len(engine.optimizer.offload.windows) > 1, "the step should stream several windows"
        assert not bf16 or isinstance(engine.optimizer.path, TransientGradients), "bf16 should step the windowed fp32 copies"
        losses = train(engine, 0, STEPS)
        params = params_of(engine)
        engine.close()
        return losses, params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_late_branches_step_as_torch_adamw_steps_them(dist_run, stage):
    results = dist_run(2, run, stage)
    ref_losses, ref_params, init = reference()
    assert_trained(ref_params, init)
    for rank, (losses, params) in enumerate(results):
        # fp32: summation order only (assert_matches_reference's rtol 1e-5); the late branches were off by ~5e-3
        assert_matches_reference(rank, losses, params, ref_losses, ref_params, f"stage {stage}")


def test_late_branches_with_the_host_step_of_offload_optimizer(dist_run):
    results = dist_run(2, run, 2, False, True)
    ref_losses, ref_params, _ = reference()
    for rank, (losses, params) in enumerate(results):
        assert_matches_reference(rank, losses, params, ref_losses, ref_params, "offload_optimizer cpu")


def test_late_branches_with_bf16_transient_gradients(dist_run):
    results = dist_run(2, run, 2, True)
    model = Branches().to(torch.bfloat16)

    def batches():
        for step in range(STEPS):
            model.path = PATHS[step]  # mixed_precision_reference calls model(x) right after taking the batch
            x, y = global_batch(step, ROWS)
            yield x.to(torch.bfloat16), y

    ref_losses, ref_params = mixed_precision_reference(model, adamw, batches(),
                                                       lambda out, y, m: F.mse_loss(out.float(), y), CLIP)
    for losses, params in results:
        # bf16: tests/dist/test_precision.py's tolerance (2 bf16 ulps, 8e-3 relative) and its Adam rule: an element
        # whose gradient is near zero may move by up to 2 lr per step the other way; 98% of each tensor must agree.
        # A late branch bias-corrected with its chunk's count is off by ~lr/4 in every element and fails.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=8e-3, atol=0)
        for name, ref in ref_params.items():
            close = (params[name] - ref).abs() <= 8e-3 * (ref.abs() + ref.abs().max())
            assert float((params[name] - ref).abs().max()) <= 2 * LR * STEPS
            assert float(close.float().mean()) >= 0.98, f"{name}: {int((~close).sum())} elements differ"


# -- checkpoints -------------------------------------------------------------------------------------


def save_and_resume(ckpt_dir: str, stage: int) -> dict:
    """The run straight through, and the same run saved after SAVE_AT steps and resumed in a fresh engine."""
    with optimizer_chunks(CHUNK):
        straight = run(stage)
        model = Branches()
        engine = zerodp.initialize(model, adamw(model), config(stage))
        first = train(engine, 0, SAVE_AT)
        engine.save_checkpoint(ckpt_dir, tag="late")
        engine.close()
        torch.manual_seed(3)
        model = Branches()
        model.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)  # other values
        engine = zerodp.initialize(model, adamw(model), config(stage))
        engine.load_checkpoint(ckpt_dir, tag="late")
        second = train(engine, SAVE_AT, STEPS - SAVE_AT)
        resumed = (first + second, params_of(engine))
        engine.close()
        return {"straight": straight, "resumed": resumed}


def test_resume_across_a_late_start_is_bitwise(dist_run, tmp_path):
    for rank, r in enumerate(dist_run(2, save_and_resume, str(tmp_path), 1)):
        (losses, params), (ref_losses, ref_params) = r["resumed"], r["straight"]
        assert losses == ref_losses, f"rank {rank}: losses differ after the resume"
        for name, value in ref_params.items():
            assert torch.equal(params[name], value), f"rank {rank}: {name} differs after the resume"
    meta = json.loads(next(Path(tmp_path).glob("late/meta.json")).read_text())
    assert meta["param_steps"]["b.weight"] == 2 and meta["param_steps"]["a.weight"] == 4, meta["param_steps"]


def save_at(ckpt_dir: str, stage: int) -> list[float]:
    with optimizer_chunks(CHUNK):
        model = Branches()
        engine = zerodp.initialize(model, adamw(model), config(stage))
        losses = train(engine, 0, SAVE_AT)
        engine.save_checkpoint(ckpt_dir, tag="late")
        engine.close()
        return losses


def load_and_finish(ckpt_dir: str, stage: int) -> tuple[list[float], dict, list[int]]:
    with optimizer_chunks(CHUNK):
        model = Branches()
        engine = zerodp.initialize(model, adamw(model), config(stage))
        engine.load_checkpoint(ckpt_dir, tag="late")
        counts = list(engine.optimizer.step_counts.counts)
        losses = train(engine, SAVE_AT, STEPS - SAVE_AT)
        params = params_of(engine)
        engine.close()
        return losses, params, counts


def test_counts_survive_a_resume_at_another_world_size_and_stage(dist_run, tmp_path):
    first = dist_run(2, save_at, str(tmp_path), 2)[0]
    ref_losses, ref_params, _ = reference()
    for rank, (second, params, _) in enumerate(dist_run(3, load_and_finish, str(tmp_path), 3)):
        # fp32 parity tolerance (assert_matches_reference); b's own count lost would move it by ~lr/4
        assert_matches_reference(rank, first + second, params, ref_losses, ref_params, "world 2 stage 2 -> 3 stage 3")


def test_a_checkpoint_without_counts_gives_each_parameter_its_chunks_count(dist_run, tmp_path):
    dist_run(2, save_at, str(tmp_path), 1)
    meta_file = next(Path(tmp_path).glob("late/meta.json"))
    meta = json.loads(meta_file.read_text())
    del meta["param_steps"]  # as written before per-parameter counts
    meta_file.write_text(json.dumps(meta))
    for _, _, counts in dist_run(2, load_and_finish, str(tmp_path), 1):
        assert counts == [SAVE_AT] * len(counts), counts  # what each parameter was stepped with before
