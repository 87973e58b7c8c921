"""ZeRO-Offload on the CUDA path (issue 31 item 2): one GPU, one NCCL rank, bf16 and fp32, the parity model.

Offloaded runs keep the 16-bit parameters and the compute on the GPU and step fp32 masters and states on
the host (zerodp/offload/placement.py). What must hold:
  - every offload mode steps without error and lands where the placement says (masters and states on the
    CPU, parameters on the GPU);
  - offload modes that run the same host arithmetic are bitwise equal to each other: `cpu` and `nvme` at a
    stage, and stage 3 with offload_param (cpu, nvme) beside stage 3 with offload_optimizer alone;
  - against the same CUDA run without offload, the parameters after 8 steps agree within rounding: the
    optimizer is the same torch AdamW, but its host kernels are not its GPU kernels (CUDA fuses a*b+c into
    one rounding where the CPU may round twice), so the last bits of an fp32 update may differ. The run
    prints whether they are bitwise equal, for the record;
  - a checkpoint of an offloaded run resumes exactly, at stages 1-3.

Skipped where no GPU exists; run on a lent GPU machine with `pytest -m gpu tests/gpu`.
"""

import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import global_batch, make_model, make_optimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 8


def offload_config(stage: int, bf16: bool, optimizer: str, param: str, nvme) -> dict:
    zero = {"stage": stage}
    if stage == 3:  # sharded units: under the default threshold every unit of the parity model is persistent, and
        zero["stage3_param_persistence_threshold"] = 0  # offload_param would move nothing
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, "nvme_path": str(nvme), "pin_memory": True}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": str(nvme), "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": bf16}, "gradient_clipping": 0.5,
            "zero_optimization": zero}


def train(engine, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x, y = (t.cuda() for t in global_batch(step, 8))
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def run(config: dict) -> tuple[list[float], dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model().cuda()
    with zerodp.initialize(model, make_optimizer("adamw", model), config) as engine:
        losses = train(engine, 0, STEPS)
        offloaded = config["zero_optimization"].get("offload_optimizer") is not None
        if offloaded:  # where the placement says: masters and states on the host, parameters on the GPU
            assert engine.placement.steps_on_host
            assert all(m.device.type == "cpu" for m in engine.optimizer.masters)
            assert engine.optimizer.state_of(0)["exp_avg"].device.type == "cpu"
            # the gradients reached the host as they were reduced (optim/grad_staging.py), not all at the step;
            # fp32 shards resting in files (offload_param nvme) are read per window at the step instead
            staging = engine.optimizer.plan.staging
            if not all(unit.grad_offloaded for unit in engine.units):
                assert staging.staged_copies >= STEPS and staging.nbytes() > 0
        assert all(p.device.type == "cuda" for p in engine.module.parameters())
        if config["zero_optimization"].get("offload_param") is not None:  # the shards really left the GPU
            assert any(unit.param_offloaded for unit in engine.units)
        return losses, engine.full_state_dict()


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{what}: {different} differ"


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_offload_optimizer_matches_the_run_without_offload(nccl_group, tmp_path, stage, bf16):
    plain_losses, plain = run(offload_config(stage, bf16, "none", "none", tmp_path))
    cpu_losses, cpu = run(offload_config(stage, bf16, "cpu", "none", tmp_path))
    nvme_losses, nvme = run(offload_config(stage, bf16, "nvme", "none", tmp_path))
    assert_bitwise(cpu, nvme, "offload cpu vs nvme (the same host step)")
    assert cpu_losses == nvme_losses
    print(f"stage {stage} bf16={bf16}: offload bitwise equal to no offload: "
          f"{all(torch.equal(cpu[k], plain[k]) for k in plain)}")
    # fp32: ulps of host vs GPU AdamW kernels over 8 steps (updates ~lr = 1e-2, so ~1e-9 per step). bf16: an
    # ulp of a master can flip the bf16 rounding of a parameter (2**-8 relative), which changes later gradients
    # by about that much; Adam's update is lr x a ratio of moments, so the parameters drift apart by ~lr x 2**-8
    # per step after a flip (8 steps: < 1e-3). A broken step (no update, wrong gradients) is off by ~lr x steps.
    atol = 1e-3 if bf16 else 2e-6
    for k in plain:
        torch.testing.assert_close(cpu[k], plain[k], rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(cpu_losses), torch.tensor(plain_losses), rtol=1e-2 if bf16 else 1e-5,
                               atol=0)


@pytest.mark.parametrize("bf16", [True, False])
def test_cuda_offload_param_is_bitwise_the_optimizer_offload_alone(nccl_group, tmp_path, bf16):
    """offload_param moves the 16-bit shards between uses; the values and the host step are the same."""
    _, reference = run(offload_config(3, bf16, "cpu", "none", tmp_path))
    for param in ("cpu", "nvme"):
        losses, params = run(offload_config(3, bf16, "cpu", param, tmp_path))
        assert_bitwise(params, reference, f"offload_param {param}")
    # offload_param alone: masters and states stay on the GPU, the shards rest on the host or in files
    plain_losses, plain = run(offload_config(3, bf16, "none", "none", tmp_path))
    for param in ("cpu", "nvme"):
        losses, params = run(offload_config(3, bf16, "none", param, tmp_path))
        assert_bitwise(params, plain, f"offload_param {param} without optimizer offload")
        assert losses == plain_losses


@pytest.mark.parametrize("stage,param", [(1, "none"), (2, "none"), (3, "none"), (3, "cpu"), (3, "nvme")])
def test_cuda_offloaded_checkpoint_round_trip(nccl_group, tmp_path, stage, param):
    torch.backends.cuda.matmul.allow_tf32 = False
    config = offload_config(stage, True, "cpu", param, tmp_path / "nvme")
    (tmp_path / "nvme").mkdir()
    model = make_model().cuda()
    with zerodp.initialize(model, make_optimizer("adamw", model), config) as engine:
        train(engine, 0, 2)
        engine.save_checkpoint(tmp_path / "ckpt")
        saved = engine.full_state_dict()
        uninterrupted = train(engine, 2, 2)
        after = engine.full_state_dict()
    fresh = make_model(seed=3).cuda()
    with zerodp.initialize(fresh, make_optimizer("adamw", fresh), config) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert_bitwise(resumed.full_state_dict(), saved, "resumed vs saved")
        state = resumed.optimizer.state_of(0)
        assert state["exp_avg"].device.type == "cpu"  # the host step's state
        # the same host step on the same values and the same GPU kernels: equal up to nondeterministic GPU
        # reductions, if any (as test_cuda_checkpoint.py)
        torch.testing.assert_close(torch.tensor(train(resumed, 2, 2)), torch.tensor(uninterrupted), rtol=1e-6, atol=0)
        continued = resumed.full_state_dict()
        for k in after:
            torch.testing.assert_close(continued[k], after[k], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_gradient_copy_lands_pinned_and_widens_exactly(dtype):
    """ZeRO-Offload's gradient copy (optim/grad_staging.py [Note: 16-bit copies, widened on the host]) lands in the
    last bytes of a pinned fp32 buffer: that view must be pinned too, or the non-blocking copy would be a staged
    host copy that blocks; widened on the host, it is the shard's exact fp32 value."""
    from zerodp.optim.grad_staging import landing_view, widen_in_place

    numel = (1 << 20) + 3  # several blocks and a tail
    shard = torch.randn(numel, device="cuda").to(dtype)
    buf = torch.empty(numel, pin_memory=True)
    landing = landing_view(buf, dtype)
    assert landing.is_pinned() and landing.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    landing.copy_(shard, non_blocking=True)
    torch.cuda.synchronize()
    widen_in_place(buf, landing)
    assert torch.equal(buf, shard.float().cpu())
