"""DeepSpeed's launcher on zerodp (zerodp.deepspeed.launcher), without starting a process: the hostfile and its
filters mean what they mean in DeepSpeed, and each launcher's command line is the cluster tool starting one
torchrun per host, carrying the alias and `.deepspeed_env`. (The launch itself, for real: tests/e2e/
test_deepspeed_launcher.py.)"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict

import pytest

from zerodp.deepspeed.launcher import launch, multinode, runner
from zerodp.deepspeed.launcher.hostfile import LauncherError, active_resources, parse_hostfile

HOSTFILE = "worker-0 slots=4\n# a comment\n\nworker-1 slots=4\nworker-2 slots=2\n"

# (include, exclude, num_nodes, num_gpus) -> the active resources DeepSpeed 0.19.8 computes for HOSTFILE
# (deepspeed.launcher.runner.parse_inclusion_exclusion + apply_num_nodes_and_gpus, run once in /work/dsvenv)
DEEPSPEED_ANSWERS = [
    (("", "", -1, -1), {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
    (("worker-0@worker-1:0,2", "", -1, -1), {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
    (("", "worker-1:0", -1, -1), {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3], "worker-2": [0, 1]}),
    (("", "worker-1", -1, -1), {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1]}),
    (("worker-2:1@worker-0", "", -1, -1), {"worker-0": [0, 1, 2, 3], "worker-2": [1]}),  # the hostfile's order
    (("", "worker-0:0,1,2,3@worker-2:0", -1, -1), {"worker-1": [0, 1, 2, 3], "worker-2": [1]}),
    (("", "", 2, -1), {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    (("", "", -1, 1), {"worker-0": [0], "worker-1": [0], "worker-2": [0]}),
    (("", "", 2, 3), {"worker-0": [0, 1, 2], "worker-1": [0, 1, 2]}),
    (("worker-1:3,1", "", -1, -1), {"worker-1": [1, 3]}),
]


@pytest.mark.parametrize("filters,expected", DEEPSPEED_ANSWERS, ids=[str(f) for f, _ in DEEPSPEED_ANSWERS])
def test_filters_mean_what_they_mean_in_deepspeed(filters, expected):
    got = active_resources(parse_hostfile(HOSTFILE), *filters)
    assert list(got.items()) == list(expected.items())


@pytest.mark.parametrize("text,message", [
    ("worker-0 slots=4\nworker-1 4\n", r"hostfile:2: 'worker-1 4' is not a hostfile line; .*NAME slots=N"),
    ("worker-0 slots=4\nworker-0 slots=2\n", r"hostfile:2: host 'worker-0' is listed twice"),
    ("# nothing\n", r"lists no host"),
])
def test_a_bad_hostfile_is_one_error_naming_the_line(text, message):
    with pytest.raises(LauncherError, match=message):
        parse_hostfile(text)


@pytest.mark.parametrize("filters,message", [
    (("worker-9", "", -1, -1), r"--include: host 'worker-9' is not in the hostfile"),
    (("worker-2:5", "", -1, -1), r"host 'worker-2' has no slot 5 \(the hostfile gives it slots 0..1\)"),
    (("worker-0", "worker-1", -1, -1), r"cannot be combined"),
    (("worker-0", "", 1, -1), r"--num_nodes/--num_gpus cannot be combined"),
    (("", "", 4, -1), r"--num_nodes 4: the hostfile has only 3 host"),  # DeepSpeed quietly uses the 3
    (("", "worker-0@worker-1@worker-2", -1, -1), r"leaves no slot"),
    (("worker-0:x", "", -1, -1), r"slots of 'worker-0' must be integers"),
])
def test_a_filter_that_cannot_work_is_one_error(filters, message):
    with pytest.raises(LauncherError, match=message):
        active_resources(parse_hostfile(HOSTFILE), *filters)


def _plan(**kw) -> multinode.LaunchPlan:
    active = kw.pop("active", OrderedDict([("worker-0", [0, 1]), ("worker-1", [0, 1])]))
    return multinode.LaunchPlan(active=active, master_addr="worker-0", master_port=29600, script="train.py",
                                script_args=["--deepspeed_config", "ds config.json"], cwd="/work/job",
                                python="/env/bin/python", exports=OrderedDict([("ZERODP_DEEPSPEED_ALIAS", "1"),
                                                                               ("NCCL_DEBUG", "INFO")]), **kw)


WORLD = launch.encode_world_info(OrderedDict([("worker-0", [0, 1]), ("worker-1", [0, 1])]))


def _node(where: str) -> list[str]:
    return ["/env/bin/python", "-u", "-m", "zerodp.deepspeed.launcher.launch", f"--world_info={WORLD}", where,
            "--master_addr=worker-0", "--master_port=29600", "train.py", "--deepspeed_config", "ds config.json"]


def test_pdsh_runs_one_launch_per_host_over_ssh_with_the_exports():
    command, env = multinode.multinode_command("pdsh", _plan(ssh_port=2222, venv_script="/env/bin/activate"),
                                               {"PDSH_SSH_ARGS_APPEND": "-q"})
    assert command[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
    assert command[6] == ("export ZERODP_DEEPSPEED_ALIAS=1; export NCCL_DEBUG=INFO; source /env/bin/activate; "
                          "cd /work/job; " + " ".join(_node("--node_rank=%n")).replace("ds config.json",
                                                                                        "'ds config.json'"))
    assert len(command) == 7 and env["PDSH_RCMD_TYPE"] == "ssh" and env["PDSH_SSH_ARGS_APPEND"] == "-q -p 2222"


def test_openmpi_mpich_and_slurm_start_one_launch_per_host():
    command, _ = multinode.multinode_command("openmpi", _plan(launcher_args=["--mca", "plm_rsh_agent", "ssh"]), {})
    assert command == ["mpirun", "-n", "2", "--host", "worker-0,worker-1", "--map-by", "ppr:1:node", "--mca",
                       "plm_rsh_agent", "ssh", "-x", "ZERODP_DEEPSPEED_ALIAS=1", "-x", "NCCL_DEBUG=INFO",
                       *_node("--node_rank_env=OMPI_COMM_WORLD_RANK")]
    command, _ = multinode.multinode_command("mpich", _plan(), {})
    assert command == ["mpirun", "-n", "2", "-ppn", "1", "-hosts", "worker-0,worker-1", "-genv",
                       "ZERODP_DEEPSPEED_ALIAS", "1", "-genv", "NCCL_DEBUG", "INFO", *_node("--node_rank_env=PMI_RANK")]
    command, _ = multinode.multinode_command("slurm", _plan(num_gpus=2, narrowed=True, run_id="job7"), {})
    assert command == ["srun", "-n", "2", "--ntasks-per-node=1", "--nodes=2", "--nodelist=worker-0,worker-1",
                       "--gpus-per-node=2", "--export=ALL,ZERODP_DEEPSPEED_ALIAS=1,NCCL_DEBUG=INFO",
                       *_node("--c10d=job7")]


def test_launchers_refuse_what_they_cannot_do():
    with pytest.raises(LauncherError, match=r"--launcher 'impi' is not supported; choose one of pdsh, openmpi"):
        multinode.multinode_command("impi", _plan(), {})
    uneven = OrderedDict([("worker-0", [0, 1]), ("worker-1", [1])])
    with pytest.raises(LauncherError, match=r"slurm runs the same slots on every host .* use --launcher pdsh"):
        multinode.multinode_command("slurm", _plan(active=uneven), {})
    plan = _plan()
    plan.exports["X"] = "a,b"
    with pytest.raises(LauncherError, match=r"X's value contains a comma"):
        multinode.multinode_command("slurm", plan, {})


@pytest.mark.parametrize("where,env,rank,slots", [
    (["--node_rank=1"], {}, 1, [3]),
    (["--node_rank_env=OMPI_COMM_WORLD_RANK"], {"OMPI_COMM_WORLD_RANK": "0"}, 0, [0, 2]),
])
def test_each_host_becomes_torchrun_for_its_own_slots(where, env, rank, slots):
    world = launch.encode_world_info(OrderedDict([("a", [0, 2]), ("b", [3])]))
    ns = launch._parse([f"--world_info={world}", *where, "--master_addr=a", "--master_port=29600", "--module",
                        "pkg.train", "--x", "1"])
    command, node_env = launch.node_command(ns, env)
    assert command == [sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes=2",
                       f"--nproc_per_node={len(slots)}", f"--node_rank={rank}", "--master_addr=a",
                       "--master_port=29600", "-m", "zerodp.deepspeed.run", "--local_rank", "--module", "pkg.train",
                       "--x", "1"]
    assert node_env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, slots)) and node_env["ZERODP_DEEPSPEED_ALIAS"] == "1"


def test_without_a_node_rank_hosts_meet_through_c10d_and_must_run_the_same_slots():
    world = launch.encode_world_info(OrderedDict([("a", [0, 1]), ("b", [0, 1])]))
    ns = launch._parse([f"--world_info={world}", "--c10d=job7", "--master_addr=a", "--master_port=29600",
                        "--no_local_rank", "t.py"])
    command, _ = launch.node_command(ns, {})
    assert command[4:10] == ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=a:29600",
                             "--rdzv_id=job7", "-m"] and command[-2:] == ["zerodp.deepspeed.run", "t.py"]
    ns = launch._parse([f"--world_info={world}", "--node_rank_env=PMI_RANK", "--master_addr=a", "--master_port=1",
                        "t.py"])
    with pytest.raises(LauncherError, match=r"--node_rank_env PMI_RANK: the variable is None on this host"):
        launch.node_command(ns, {})


def test_exports_carry_the_alias_deepspeeds_prefixes_and_the_deepspeed_env_file(tmp_path):
    home, here = tmp_path / "home.env", tmp_path / "here.env"
    home.write_text("NCCL_IB_DISABLE=1\nFOO=home\n")
    here.write_text("# mine\n\nFOO=here=too\n")
    got = multinode.exports({"NCCL_DEBUG": "INFO", "UCX_TLS": "tcp", "PYTHONPATH": "/lib", "HOME": "/h",
                             "ZERODP_WATCHDOG_S": "60"}, [home, here, tmp_path / "missing"], "/work/job")
    assert got == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/work/job:/lib", "UCX_TLS": "tcp", "ZERODP_WATCHDOG_S": "60",
                   "ZERODP_DEEPSPEED_ALIAS": "1", "NCCL_IB_DISABLE": "1", "FOO": "here=too"}
    here.write_text("JUST_A_NAME\n")
    with pytest.raises(LauncherError, match=r"here.env:1: 'JUST_A_NAME' is not NAME=VALUE"):
        multinode.exports({}, [here], "/w")


def _plan_launch(tmp_path, *argv, env=None):
    return runner.plan_launch(runner.parse_args(list(argv)), {"PATH": "/usr/bin", **(env or {})})


def test_one_host_runs_torchrun_here_and_several_go_through_the_launcher(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("localhost slots=4\n")
    command, env = _plan_launch(tmp_path, "--hostfile", "hosts", "--master_port", "29601", "t.py", "--lr", "1")
    assert command == [sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=4",
                       "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=29601", "-m", "zerodp.deepspeed.run",
                       "--local_rank", "t.py", "--lr", "1"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and env["ZERODP_DEEPSPEED_ALIAS"] == "1"
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    command, _ = _plan_launch(tmp_path, "--hostfile", "hosts", "--launcher", "OpenMPI", "t.py")
    assert command[:5] == ["mpirun", "-n", "2", "--host", "node-a,node-b"]
    assert "--master_addr=node-a" in command  # the first host, as the hostfile names it
    command, _ = _plan_launch(tmp_path, "--hostfile", "hosts", "--include", "node-b", "--launcher_args=--mca x", "t.py")
    assert command[4:6] == ["--nnodes=1", "--nproc_per_node=2"]  # a filter that leaves one host: torchrun here
    assert "--launcher_args '--mca x' is not used" in capsys.readouterr().err  # said, not silently dropped
    command, _ = _plan_launch(tmp_path, "--hostfile", "hosts", "--include", "node-b", "--force_multi", "t.py")
    assert command[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node-b"]
    command, env = _plan_launch(tmp_path, "--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "t.py")
    assert command[:4] == [sys.executable, "-u", "-m", "zerodp.deepspeed.launcher.launch"]  # this host's part only
    ns = launch._parse(command[4:])
    assert (ns.node_rank, ns.master_addr, ns.script) == (1, "node-a", "t.py")
    assert launch.decode_world_info(ns.world_info) == {"node-a": [0, 1], "node-b": [0, 1]}
    assert env["ZERODP_DEEPSPEED_ALIAS"] == "1"


@pytest.mark.parametrize("argv,message", [
    (["--hostfile", "nope", "t.py"], r"--hostfile nope: no such file"),
    (["--autotuning", "tune", "t.py"], r"--autotuning: zerodp's launcher does not provide autotuning"),
    (["--no_python", "t.py"], r"--no_python: .*non-Python programs"),
    (["--bind_cores_to_rank", "t.py"], r"--bind_cores_to_rank: .*core binding"),
    (["--save_pid", "t.py"], r"--save_pid: .*the pid file"),
    (["--enable_each_rank_log", "logs", "t.py"], r"--enable_each_rank_log: .*per-rank log files"),
    (["--no_ssh", "t.py"], r"--no_ssh starts only this host's part: give its --node_rank"),
    (["--launcher", "impi", "t.py"], r"--launcher 'impi' is not supported; choose one of pdsh, openmpi, mpich, slurm"),
    (["--launcher", "slurm", "--venv_script", "v.sh", "t.py"], r"--venv_script is for --launcher pdsh"),
])
def test_bad_launches_are_refused_before_anything_starts(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(tmp_path / "absent"))
    with pytest.raises(LauncherError, match=message):
        _plan_launch(tmp_path, *argv)


def test_without_hostfile_or_gpu_the_cpu_ranks_are_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(tmp_path / "absent"))
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    with pytest.raises(LauncherError, match=r"no hostfile and no GPU on this machine: pass --num_gpus N"):
        _plan_launch(tmp_path, "t.py")
    command, _ = _plan_launch(tmp_path, "--num_gpus", "3", "t.py")
    assert "--nproc_per_node=3" in command
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)  # with GPUs: one rank per GPU
    command, env = _plan_launch(tmp_path, "t.py")
    assert "--nproc_per_node=2" in command and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_missing_cluster_tool_is_named(tmp_path, monkeypatch):
    ns = runner.parse_args(["--launcher", "slurm", "t.py"])
    with pytest.raises(LauncherError, match=r"--launcher slurm needs `srun` on PATH"):
        runner._check_reachable(ns, ["srun", "-n", "2"], {"PATH": str(tmp_path)})


def test_the_deepspeed_env_file_name_follows_ds_env_file():
    assert [p.name for p in multinode.deepspeed_env_files({})] == [".deepspeed_env", ".deepspeed_env"]
    files = multinode.deepspeed_env_files({"DS_ENV_FILE": "cluster.env"})
    assert [str(p.parent) for p in files] == [os.path.expanduser("~"), "."] and files[1].name == "cluster.env"


def test_pdsh_needs_passwordless_ssh_to_the_first_host_unless_told_not_to_check(tmp_path):
    for tool, code in (("pdsh", 0), ("ssh", 255)):  # stand-ins: ssh refuses
        (tmp_path / tool).write_text(f"#!/bin/sh\nexit {code}\n")
        (tmp_path / tool).chmod(0o755)
    env = {"PATH": str(tmp_path)}
    command = ["pdsh", "-S", "-f", "1024", "-w", "node-a,node-b", "remote command"]
    with pytest.raises(LauncherError, match=r"host node-a is not reachable by passwordless ssh \(ssh -o "
                                            r"PasswordAuthentication=no -p 2222 node-a hostname failed\)"):
        runner._check_reachable(runner.parse_args(["--ssh_port", "2222", "t.py"]), command, env)
    runner._check_reachable(runner.parse_args(["--no_ssh_check", "t.py"]), command, env)  # no probe


def test_run_runs_a_module_as_python_m_with_local_rank_first(tmp_path, monkeypatch):
    # DeepSpeed's `--module`: each rank runs `python -m zerodp.deepspeed.run --local_rank --module pkg.train ARGS`
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    out = tmp_path / "seen.txt"
    (tmp_path / "pkg" / "train.py").write_text(
        f"import sys, deepspeed\nopen({str(out)!r}, 'w').write(__name__ + ' ' + deepspeed.__name__ + ' ' + "
        f"' '.join(sys.argv[1:]))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("LOCAL_RANK", "3")
    saved = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith(("deepspeed.", "pkg"))}
    saved_path = list(sys.meta_path)
    from zerodp.deepspeed.run import main

    try:
        main(["--local_rank", "--module", "pkg.train", "--zero_stage", "2"])
        assert out.read_text() == "__main__ zerodp.adapters.deepspeed --local_rank=3 --zero_stage 2"  # the alias
    finally:
        for k in [k for k in sys.modules if k == "deepspeed" or k.startswith(("deepspeed.", "pkg"))]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.meta_path[:] = saved_path


def test_the_default_hostfile_and_cuda_visible_devices_are_read_as_deepspeed_reads_them(tmp_path, monkeypatch):
    default = tmp_path / "job-hostfile"
    default.write_text("node-a slots=2\nnode-b slots=2\n")
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(default))  # /job/hostfile in DeepSpeed and here
    command, _ = _plan_launch(tmp_path, "--launcher", "mpich", "t.py")
    assert command[:7] == ["mpirun", "-n", "2", "-ppn", "1", "-hosts", "node-a,node-b"]
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(tmp_path / "absent"))
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)  # as torch counts under CUDA_VISIBLE_DEVICES=2,3
    command, env = _plan_launch(tmp_path, "t.py", env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert "--nproc_per_node=2" in command and env["CUDA_VISIBLE_DEVICES"] == "2,3"  # the same two devices
