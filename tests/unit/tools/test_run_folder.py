"""The run folder's rules (no process group): reuse refused, --overwrite clears only a run's files,
the writability probe leaves no trace, periodic checkpoints rotate; and a launcher failure as one line."""

from __future__ import annotations

import json
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from zerodp.tools.app import run_folder
from zerodp.tools.cli.launch_report import failure_line


def test_a_folder_holding_a_run_is_refused_unless_continued_or_overwritten(tmp_path):
    out = tmp_path / "run"
    run_folder.prepare(out, continuing=False, overwrite=False)  # a fresh folder is fine
    (out / "checkpoints" / "global_step5").mkdir(parents=True)
    (out / "run.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(run_folder.RunFolderError, match="already holds a run .*run.json, checkpoints/.*--overwrite"):
        run_folder.prepare(out, continuing=False, overwrite=False)
    run_folder.prepare(out, continuing=True, overwrite=False)  # --resume of it, or a restart
    assert (out / "run.json").exists()
    run_folder.prepare(out, continuing=False, overwrite=True)
    assert not (out / "run.json").exists() and not (out / "checkpoints" / "global_step5").exists()
    assert (out / "notes.txt").read_text() == "mine"  # only what a run writes is removed


def test_other_ranks_write_probes_are_not_a_run(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".write-test-123").write_text("ok")
    assert run_folder.previous_run(tmp_path) == []


def test_writability_probe_leaves_no_trace_and_names_the_problem(tmp_path):
    run_folder.check_writable(tmp_path / "a" / "b" / "checkpoints")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(run_folder.RunFolderError, match="cannot write to .*choose a writable --out"):
        run_folder.check_writable(tmp_path / "file" / "checkpoints")


def test_periodic_checkpoints_rotate(tmp_path):
    rotation = run_folder.CheckpointRotation(tmp_path, keep=2)
    for step in (5, 10, 15):
        (tmp_path / f"global_step{step}").mkdir()
        rotation.add(str(tmp_path / f"global_step{step}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step10", "global_step15"]


def test_restart_checkpoint_needs_a_complete_one(tmp_path):
    assert run_folder.restart_checkpoint(tmp_path) is None
    tag = tmp_path / "checkpoints" / "global_step5"
    tag.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("global_step5\n")
    assert run_folder.restart_checkpoint(tmp_path) is None  # no meta.json: not complete
    (tag / "meta.json").write_text("{}")
    assert run_folder.restart_checkpoint(tmp_path) == tmp_path / "checkpoints"


def _child_failed(tmp_path, exitcode: int, message=None) -> ChildFailedError:
    error_file = tmp_path / "error.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "Tb",
                                                                                           "timestamp": "1"}}}))
    failure = ProcessFailure(local_rank=1, pid=42, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("run_worker", {1: failure})


@pytest.mark.parametrize("exitcode, message, code, needle", [
    (1, "CheckpointError: checkpoint x has other shapes;\n use the same model", 2,
     "rank 1: CheckpointError: checkpoint x has other shapes; use the same model"),
    (1, "RuntimeError: boom", 1, "rank 1: RuntimeError: boom"),
    (-signal.SIGKILL, None, 1, "rank 1 was killed by SIGKILL"),
])
def test_launcher_failure_is_one_line_with_the_report_in_a_file(tmp_path, exitcode, message, code, needle):
    log = tmp_path / "launcher.log"
    got_code, line = failure_line(_child_failed(tmp_path, exitcode, message), log)
    assert got_code == code and needle in line and "\n" not in line
    assert f"(full report: {log})" in line
    assert "ChildFailedError" in log.read_text()
