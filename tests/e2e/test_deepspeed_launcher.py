"""DeepSpeed's launcher on zerodp, for real (issue 41, part 4): `python -m zerodp.deepspeed.launcher.runner
--hostfile H train.py ...` with the hostfile `localhost slots=4` starts one world of 4 ranks (torchrun here) that
trains a DeepSpeed script (`import deepspeed`: the alias is carried) with the losses of plain PyTorch on the global
batch; with two hosts that both are this machine (`--no_ssh --node_rank N`, the per-host half that pdsh, mpirun
or srun start on each host) the two torchruns form the same world of 4 (slow). DeepSpeed's own `deepspeed`
command reaches this launcher under ZERODP_DEEPSPEED_ALIAS=1. The command lines of every launcher:
tests/unit/adapters/test_deepspeed_launcher.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.multinode_check import free_port
from tests.e2e.test_deepspeed_script import SCRIPT_DIR, TOTAL, ds_config, reference

WORLD = 4  # ranks; ds_config's train_batch_size 8 = micro-batch 2 x 4 ranks x accumulation 1


def _script_and_config(tmp_path: Path) -> tuple[Path, Path]:
    """train_ds.py as a DeepSpeed user has it (`import deepspeed`), and its config at stage 2."""
    source = (SCRIPT_DIR / "train_ds.py").read_text()
    script = tmp_path / "train.py"
    script.write_text(source.replace("import zerodp.deepspeed as deepspeed  # was: import deepspeed",
                                     "import deepspeed"))
    assert "import deepspeed\n" in script.read_text()
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(2)))
    return script, config


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def _check_world_of_4(tmp_path: Path) -> None:
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert (result["world_size"], result["train_batch_size"], result["stage"]) == (WORLD, 8, 2)
    losses, lrs, _ = reference(world=WORLD, micro=2, gas=1, steps=TOTAL)
    assert result["lrs"] == pytest.approx(lrs, abs=1e-12)
    # fp32; the ranks sum their gradients in another order than the single process: test_deepspeed_script's bound
    assert result["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)


@pytest.mark.timeout(300)
def test_hostfile_localhost_slots_4_trains_one_world_of_4(tmp_path):
    script, config = _script_and_config(tmp_path)
    (tmp_path / "hostfile").write_text("localhost slots=4\n")
    proc = subprocess.run([sys.executable, "-m", "zerodp.deepspeed.launcher.runner", "--hostfile",
                           str(tmp_path / "hostfile"), "--master_port", str(free_port()), str(script), "--deepspeed",
                           "--deepspeed_config", str(config), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=280, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "torch.distributed.run --nnodes=1 --nproc_per_node=4" in proc.stderr  # the command it ran, printed
    _check_world_of_4(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_hosts_of_one_machine_form_one_world_of_4(tmp_path):
    script, config = _script_and_config(tmp_path)
    (tmp_path / "hostfile").write_text("localhost slots=2\n127.0.0.1 slots=2\n")  # two names, one machine
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "zerodp.deepspeed.launcher.runner", "--hostfile",
                               str(tmp_path / "hostfile"), "--no_ssh", "--node_rank", str(rank), "--master_addr",
                               "127.0.0.1", "--master_port", str(port), str(script), "--deepspeed",
                               "--deepspeed_config", str(config), "--out", str(tmp_path / "out")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
             for rank in range(2)]
    results = [node.communicate(timeout=380) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, results):
        assert node.returncode == 0, f"exit {node.returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    _check_world_of_4(tmp_path)


MISSING = "no such file; write one host a line as `NAME slots=N`, or leave --hostfile out to run on this machine only"


@pytest.mark.timeout(120)
def test_a_deepspeed_link_to_zerodp_deepspeed_is_this_launcher(tmp_path):
    command = Path(sys.executable).with_name("zerodp-deepspeed")  # the console script pyproject installs
    assert command.is_file(), "reinstall zerodp (make setup) for its zerodp-deepspeed command"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "deepspeed").symlink_to(command)  # the opt-in docs/multinode_elastic.md describes
    proc = subprocess.run(["deepspeed", "--hostfile", str(tmp_path / "missing"), "train.py"], capture_output=True,
                          text=True, timeout=100, env=dict(_env(), PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}"))
    assert proc.returncode == 1 and proc.stderr.strip() == \
        f"zerodp-deepspeed: error: --hostfile {tmp_path / 'missing'}: {MISSING}", proc.stderr


@pytest.mark.timeout(120)
def test_deepspeeds_own_command_reaches_this_launcher_under_the_alias(tmp_path):
    # the body of DeepSpeed's bin/deepspeed script, run under ZERODP_DEEPSPEED_ALIAS=1 (docs/multinode_elastic.md)
    body = "from deepspeed.launcher.runner import main; main()"
    proc = subprocess.run([sys.executable, "-c", body, "--hostfile", str(tmp_path / "missing"), "train.py"],
                          capture_output=True, text=True, timeout=100, env=dict(_env(), ZERODP_DEEPSPEED_ALIAS="1"))
    assert proc.returncode == 1 and proc.stderr.strip() == \
        f"zerodp-deepspeed: error: --hostfile {tmp_path / 'missing'}: {MISSING}", proc.stderr
