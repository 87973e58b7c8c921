"""On a GPU host nothing after tests/gpu sees its NCCL group or ZERODP_REAL_COLLECTIVES (issue 31 item 6):
the group helper undoes both on exit (checked here with gloo), the fixture is package-scoped, and
`make test` runs tests/gpu in a pytest process of its own."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.gpu.one_rank import one_rank_group
from zerodp import comm

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("before", [None, "0"])
def test_one_rank_group_is_undone_on_exit(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(comm.REAL_COLLECTIVES_ENV, raising=False)
    else:
        monkeypatch.setenv(comm.REAL_COLLECTIVES_ENV, before)
    with pytest.raises(ValueError, match="inside"):  # also when a test inside fails
        with one_rank_group("gloo"):
            assert dist.is_initialized() and os.environ[comm.REAL_COLLECTIVES_ENV] == "1"
            assert not comm.skips_collectives()
            raise ValueError("inside")
    assert not dist.is_initialized()
    assert os.environ.get(comm.REAL_COLLECTIVES_ENV) == before


def test_the_fixture_lives_for_tests_gpu_only():
    tree = ast.parse((ROOT / "tests" / "gpu" / "conftest.py").read_text())
    scopes = {f.name: [kw.value.value for d in f.decorator_list if isinstance(d, ast.Call)
                       for kw in d.keywords if kw.arg == "scope"]
              for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert scopes["nccl_group"] == ["package"]


def test_make_test_runs_tests_gpu_in_a_process_of_its_own():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test: setup\n((?:\t.*\n)+)", makefile, re.M).group(1).replace("\\\n", " ")
    runs = [cmd for cmd in re.split(r";|&&", recipe) if "pytest" in cmd]
    folders = [set(re.findall(r"tests/\w+", cmd)) for cmd in runs]
    assert {"tests/unit", "tests/dist", "tests/hf", "tests/e2e", "tests/gpu"} <= set().union(*folders)
    assert [f for f in folders if "tests/gpu" in f] == [{"tests/gpu"}]
    # on a GPU host the CPU folders still test what CI tests: zerodp's GPU defaults (NCCL, --nproc = GPUs) stay out
    cpu_runs = [cmd for cmd, f in zip(runs, folders) if "tests/e2e" in f]
    assert cpu_runs and all(re.search(r"CUDA_VISIBLE_DEVICES=\s", cmd) for cmd in cpu_runs)
