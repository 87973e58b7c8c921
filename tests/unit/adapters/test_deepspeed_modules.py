"""The `deepspeed.*` modules real scripts import, beyond `initialize` (zerodp/adapters/deepspeed/): each works as in
DeepSpeed or refuses with one line when called; the alias makes `import deepspeed.X` resolve to them."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from zerodp.deepspeed import _usable_backend
from zerodp.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zerodp.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerodp.deepspeed.runtime.utils import set_random_seed
from zerodp.deepspeed.utils import RepeatingLoader, log_dist, set_z3_leaf_modules
from zerodp.optimizers.fused_adam import FusedAdam as ZerodpFusedAdam


def test_moe_split_returns_dense_groups_unchanged():
    model = torch.nn.Linear(3, 2)
    group = {"params": model.parameters(), "name": "parameters", "lr": 0.1}
    out = split_params_into_different_moe_groups_for_optimizer(group)
    assert out == [group] and out[0]["params"] == list(model.parameters())  # a dict becomes a list
    groups = ({"params": [model.weight], "name": "a"}, {"params": [model.bias], "name": "b"})
    assert split_params_into_different_moe_groups_for_optimizer(groups) == list(groups)
    with pytest.raises(ValueError, match="Unknown param group type"):
        split_params_into_different_moe_groups_for_optimizer(model.parameters())


def test_moe_parameters_and_layers_are_refused():
    expert = torch.nn.Linear(2, 2)
    expert.weight.allreduce = False  # how DeepSpeed's MoE layers mark expert parameters
    with pytest.raises(NotImplementedError, match="zerodp does not support MoE"):
        split_params_into_different_moe_groups_for_optimizer({"params": list(expert.parameters()), "name": "p"})
    from zerodp.deepspeed.moe.layer import MoE

    with pytest.raises(NotImplementedError, match="MoE is not supported by zerodp"):
        MoE(hidden_size=4, expert=expert, num_experts=2)


def test_ops_adam_build_the_same_update_in_torch():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = FusedAdam(params, lr=0.1, weight_decay=0.01)
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.01  # adam_w_mode=True
    assert type(FusedAdam(params, adam_w_mode=False)) is torch.optim.Adam
    assert type(FusedAdam(params, bias_correction=False)) is ZerodpFusedAdam
    cpu = DeepSpeedCPUAdam(params, lr=0.2)
    assert type(cpu) is torch.optim.AdamW and cpu.defaults["weight_decay"] == 0  # DeepSpeedCPUAdam's default 0
    assert type(DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        DeepSpeedCPUAdam(params, fp32_optimizer_states=False)


def test_utils_helpers():
    loader = RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]
    linear = torch.nn.Linear(1, 1)  # leaves are implemented (test_deepspeed_framework_surface.py); a missing class:
    assert set_z3_leaf_modules(linear, [torch.nn.Linear]) == [linear]
    with pytest.raises(ValueError, match="no module of"):
        set_z3_leaf_modules(linear, [torch.nn.ReLU])
    set_random_seed(3)
    a = torch.rand(2)
    set_random_seed(3)
    assert torch.equal(a, torch.rand(2))


def test_log_dist_logs_without_a_process_group(caplog):
    from zerodp.deepspeed.utils.logging import logger

    logger.propagate = True  # let caplog see it
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            log_dist("hello", ranks=[0])
    finally:
        logger.propagate = False
    assert "[Rank -1] hello" in caplog.text


def test_backend_list_keeps_what_torch_has():
    nccl = torch.distributed.is_nccl_available() and torch.cuda.is_available()
    assert _usable_backend("gloo") == "gloo"
    assert _usable_backend("cpu:gloo,cuda:nccl") == ("cpu:gloo,cuda:nccl" if nccl else "cpu:gloo")
    if not nccl:
        with pytest.raises(RuntimeError, match="none of these backends"):
            _usable_backend("cuda:nccl")


@pytest.mark.parametrize("gpu", [False, True])
def test_nccl_built_without_a_gpu_chooses_gloo(monkeypatch, gpu):
    """A CUDA build of torch on a machine without a GPU (issue 31, item 4): NCCL is built, no GPU is visible,
    and every backend choice must fall back to gloo; with a GPU, NCCL stays."""
    from zerodp.comm import backend

    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert _usable_backend("cpu:gloo,cuda:nccl") == ("cpu:gloo,cuda:nccl" if gpu else "cpu:gloo")
    assert backend.default_backend() == ("nccl" if gpu else "gloo")  # comm.init_distributed's choice
    if not gpu:
        with pytest.raises(RuntimeError, match="NCCL needs a visible GPU"):
            _usable_backend("cuda:nccl")
    # the choice as data: NCCL needs both answers
    assert [backend.choose_backend(c, n) for c, n in ((True, True), (True, False), (False, True), (False, False))] \
        == ["nccl", "gloo", "gloo", "gloo"]


@pytest.fixture
def alias():
    """Install the alias, then restore sys.modules and sys.meta_path."""
    from zerodp.adapters.deepspeed import alias as alias_mod

    saved_modules = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    saved_path = list(sys.meta_path)
    alias_mod.install()
    yield alias_mod
    for k in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
        del sys.modules[k]
    sys.modules.update(saved_modules)
    sys.meta_path[:] = saved_path


def test_alias_resolves_deepspeed_imports_to_zerodp(alias):
    import importlib

    import zerodp.deepspeed

    assert importlib.import_module("deepspeed") is zerodp.deepspeed
    for name in ("accelerator", "comm", "moe.utils", "ops.adam", "utils.logging", "runtime.utils", "zero",
                 "runtime.zero.partition_parameters"):
        assert importlib.import_module(f"deepspeed.{name}") is importlib.import_module(f"zerodp.deepspeed.{name}")
    from deepspeed import get_accelerator  # noqa: F401 (the collected scripts' two spellings)
    from deepspeed.accelerator import get_accelerator as g2  # noqa: F401
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert ZeroParamStatus.NOT_AVAILABLE.value == 2  # DeepSpeed's values
    with pytest.raises(ModuleNotFoundError, match="deepspeed.pipe is not provided by zerodp"):
        importlib.import_module("deepspeed.pipe")
    assert "run" not in alias.submodules() and "alias" not in alias.submodules()


def test_comm_collectives_drop_deepspeeds_logging_keywords(monkeypatch):
    import zerodp.deepspeed.comm as comm

    seen = {}
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, **kw: seen.update(kw))
    comm.all_reduce(torch.zeros(1), op=comm.ReduceOp.SUM, log_name="x", prof=True, debug="d")
    assert seen == {"op": torch.distributed.ReduceOp.SUM}


def test_run_executes_an_unchanged_script_with_the_alias(alias, tmp_path, monkeypatch):
    # an installed DeepSpeed on sys.path must not be imported: here a package that fails if it is
    fake = tmp_path / "site" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('the real deepspeed was imported')\n")
    script = tmp_path / "train.py"
    out = tmp_path / "out.txt"
    script.write_text("import sys\nimport deepspeed\nimport deepspeed.comm as dist\n"
                      "from deepspeed.accelerator import get_accelerator\n"
                      "from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer\n"
                      f"open({str(out)!r}, 'w').write(deepspeed.__name__ + ' ' + get_accelerator().device_name()"
                      " + ' ' + str(dist.get_rank()) + ' ' + ' '.join(sys.argv[1:]))\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from zerodp.adapters.deepspeed import accelerator as acc_mod
    from zerodp.deepspeed.run import main

    monkeypatch.setattr(acc_mod, "_ACCELERATOR", None)
    main([str(script), "--stage", "2"])
    assert out.read_text() == "zerodp.adapters.deepspeed cpu 0 --stage 2"  # the module zerodp.deepspeed names (zerodp/adapters/__init__.py)
    with pytest.raises(SystemExit, match="usage"):
        main([])


def test_deepspeeds_top_level_names_not_provided_say_what_they_are():
    import zerodp.deepspeed as deepspeed

    with pytest.raises(AttributeError, match=r"deepspeed.init_inference \(DeepSpeed-Inference\) is not provided"):
        deepspeed.init_inference(torch.nn.Linear(1, 1))
    assert not hasattr(deepspeed, "PipelineModule") and not hasattr(deepspeed, "nonsense")


def test_see_memory_usage_logs_only_when_forced(caplog):
    from zerodp.deepspeed.runtime.utils import see_memory_usage
    from zerodp.deepspeed.utils.logging import logger

    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            see_memory_usage("not forced")
            see_memory_usage("after init", force=True)
    finally:
        logger.propagate = False
    assert "not forced" not in caplog.text
    assert "after init" in caplog.text and "Max_MA" in caplog.text and "CPU Virtual Memory" in caplog.text


def test_alias_presents_zerodp_as_the_deepspeed_distribution(alias):
    import importlib.metadata as metadata

    assert metadata.version("deepspeed") == alias.DEEPSPEED_VERSION == "0.19.8"
    assert metadata.metadata("DeepSpeed")["Name"] == "deepspeed"  # names compare normalized
    assert metadata.distribution("deepspeed").read_text("top_level.txt") == "deepspeed\n"
    assert "deepspeed" in [d.metadata["Name"] for d in metadata.distributions()]
    with pytest.raises(metadata.PackageNotFoundError):  # other names are not answered by the alias
        metadata.distribution("deepspeed-nonexistent")
    alias.install()  # idempotent: one finder
    assert sum(isinstance(f, alias._AliasDistributionFinder) for f in sys.meta_path) == 1
    transformers_deepspeed = pytest.importorskip("transformers.integrations.deepspeed")
    from transformers.dependency_versions_check import dep_version_check

    dep_version_check("deepspeed")  # what HfDeepSpeedConfig checks first ("deepspeed>=0.9.3")
    assert transformers_deepspeed.is_deepspeed_available()


def test_plain_import_presents_no_deepspeed_distribution():
    import importlib.metadata as metadata
    import importlib.util

    import zerodp.deepspeed  # noqa: F401
    from zerodp.adapters.deepspeed import alias as alias_mod

    assert not any(isinstance(f, alias_mod._AliasDistributionFinder) for f in sys.meta_path)
    if importlib.util.find_spec("deepspeed") is None:  # no real DeepSpeed installed here
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.version("deepspeed")


def test_constructor_wrapper_names_exist_for_transformers_but_wrap_nothing(alias):
    from zerodp.adapters.deepspeed.runtime.zero import partition_parameters as pp

    assert pp._orig_torch_arange is torch.arange
    with pytest.raises(NotImplementedError, match="does not wrap torch's tensor constructors"):
        pp.zero_wrapper_for_fp_tensor_constructor(torch.zeros)
    transformers_deepspeed = pytest.importorskip("transformers.integrations.deepspeed")
    ours = pp.zero_wrapper_for_fp_tensor_constructor
    with transformers_deepspeed.prevent_arange_dtype_change():  # entered around every ZeRO-3 from_pretrained
        assert pp.zero_wrapper_for_fp_tensor_constructor is not ours  # swapped by transformers
        assert torch.arange(3, dtype=torch.float64).dtype == torch.float64  # constructors untouched
    assert pp.zero_wrapper_for_fp_tensor_constructor is ours  # restored on exit


def test_gathered_parameters_skips_none_entries_as_deepspeed_does():
    from zerodp.deepspeed.zero import GatheredParameters

    lin = torch.nn.Linear(2, 2, bias=False)
    ctx = GatheredParameters([lin.weight, lin.bias], modifier_rank=None)  # a head without a bias
    assert ctx.params == [lin.weight]
    with ctx:
        assert lin.weight.sum().isfinite()


@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_zerodp_deepspeed_is_the_adapter_under_its_public_name():
    """`zerodp.deepspeed[.X]` are the very modules of `zerodp.adapters.deepspeed[.X]` (zerodp/adapters/__init__.py):
    one class per name whichever path imported it, and `python -m zerodp.deepspeed.run` still runs."""
    import importlib
    import subprocess

    import zerodp.adapters.deepspeed.engine as real_engine
    import zerodp.deepspeed as public
    import zerodp.deepspeed.engine as public_engine
    from zerodp.deepspeed.runtime.zero import partition_parameters

    assert public is importlib.import_module("zerodp.adapters.deepspeed")
    assert public_engine is real_engine and public_engine.DeepSpeedEngine is real_engine.DeepSpeedEngine
    assert partition_parameters is importlib.import_module("zerodp.adapters.deepspeed.runtime.zero.partition_parameters")
    done = subprocess.run([sys.executable, "-m", "zerodp.deepspeed.run", "--help"], capture_output=True, text=True)
    assert "usage: python -m zerodp.deepspeed.run" in done.stderr, done.stderr  # its usage line: the module ran
