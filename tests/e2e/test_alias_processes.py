"""ZERODP_DEEPSPEED_ALIAS=1 reaches every process: `python -m zerodp.deepspeed.run parent.py` sets it, and a
child the script starts as `[sys.executable, child.py]` (as Lightning starts its other ranks) imports
`deepspeed` as zerodp.deepspeed; with the variable unset the start-up hook imports nothing."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

from _zerodp_deepspeed_alias import DEEPSPEED_VERSION, ENV

SRC = Path(__file__).resolve().parents[2] / "src"
CHILD = """
import importlib.metadata, importlib.util, json, sys
before = {"torch": "torch" in sys.modules, "spec": importlib.util.find_spec("deepspeed") is not None,
          "version": importlib.metadata.version("deepspeed"), "torch_after_checks": "torch" in sys.modules}
import deepspeed
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
before.update(name=deepspeed.__name__, runner=DEEPSPEED_ENVIRONMENT_NAME)
print(json.dumps(before))
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_a_child_of_a_script_under_run_imports_zerodp_as_deepspeed(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys\n"
        "import deepspeed\n"
        "subprocess.run([sys.executable, __file__.replace('parent.py', 'child.py')], check=True)\n")
    proc = subprocess.run([sys.executable, "-m", "zerodp.deepspeed.run", str(tmp_path / "parent.py")],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    # the checks frameworks make before importing (accelerate's is_deepspeed_available) pass without torch
    assert seen == {"torch": False, "spec": True, "version": DEEPSPEED_VERSION, "torch_after_checks": False,
                    "name": "zerodp.adapters.deepspeed", "runner": ".deepspeed_env"}


def test_the_hook_is_installed_and_imports_nothing_when_the_variable_is_unset(tmp_path):
    pth = [Path(d) / "zerodp-deepspeed-alias.pth" for d in site.getsitepackages()]
    assert any(p.is_file() for p in pth), f"zerodp-deepspeed-alias.pth is not in {site.getsitepackages()}: " \
                                         f"reinstall zerodp (make setup)"
    probe = "import sys, importlib.util; print('_zerodp_deepspeed_alias' in sys.modules, " \
            "importlib.util.find_spec('deepspeed') is None)"
    off = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=_env())
    assert off.stdout.split() == ["False", "True"], off.stderr  # (no real DeepSpeed in zerodp's venv)
    on = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                        env=_env(**{ENV: "1"}))
    assert on.stdout.split() == ["True", "False"], on.stderr
    bad = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env=_env(**{ENV: "yes"}))
    assert bad.stdout.split() == ["True", "True"] and bad.stderr.count(f"{ENV}='yes' is not understood") == 1
