"""optim/step_kernel.py: zerodp steps CUDA masters with torch's fused Adam/AdamW unless the user said no, and
leaves CPU masters to the user's implementation (the CPU parity tests are bitwise). CUDA is data here."""

import torch

import zerodp
from zerodp.optimizers.optimizer_list import OptimizerList
from zerodp.optim.step_kernel import master_group_settings, master_step_settings

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_cuda_masters_take_the_fused_kernel_unless_the_user_refused_it():
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        for foreach in (None, False, True):
            got = master_step_settings(cls, {"lr": 1e-3, "foreach": foreach, "fused": None}, CUDA)
            assert got["fused"] is True and got["foreach"] is None and got["lr"] == 1e-3
        assert master_step_settings(cls, {"fused": False, "foreach": False}, CUDA)["fused"] is False
        assert master_step_settings(cls, {"fused": None, "differentiable": True}, CUDA)["fused"] is None
    assert "fused" not in master_step_settings(torch.optim.SGD, {"lr": 0.1}, CUDA)  # not in the table
    settings = {"fused": None, "foreach": None}
    assert master_step_settings(torch.optim.AdamW, settings, CPU) == settings  # CPU: the user's implementation
    assert settings == {"fused": None, "foreach": None}  # the caller's dict is not changed


def test_each_group_is_decided_by_its_own_optimizer():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    opts = OptimizerList([torch.optim.AdamW([a]), torch.optim.SGD([b], lr=0.1)])
    settings = [dict(g, params=None) for g in opts.param_groups]
    got = master_group_settings(opts, settings, CUDA)
    assert got[0]["fused"] is True and not got[1].get("fused")


def test_cpu_engine_keeps_the_users_implementation():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero_optimization": {"stage": 1}})
    assert all(g["fused"] is None and g["foreach"] is None for g in engine.optimizer.optimizer.param_groups)
    engine.close()


def _adamw_on_chunks(**kw) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(5000, generator=g)
    chunks = list(master.split(1024))
    opt = torch.optim.AdamW(chunks, lr=1e-3, weight_decay=0.01, **kw)
    for _ in range(3):
        for c in chunks:
            c.grad = torch.randn(c.shape, generator=g) * 1e-3
        opt.step()
    return master


def test_why_cpu_is_left_alone_and_cuda_may_fuse():
    loop = _adamw_on_chunks(foreach=False)
    # foreach: the loop's bits (so it would be a free switch), but slower on CPU chunks (step_kernel.py)
    assert torch.equal(_adamw_on_chunks(foreach=True), loop)
    # fused: the same formula, its own roundings: within a couple of ulps, not bitwise (hence CUDA only)
    torch.testing.assert_close(_adamw_on_chunks(fused=True), loop, rtol=0, atol=1e-6)
