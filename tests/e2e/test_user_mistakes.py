"""Every user mistake is one line (issue 13): a table of invalid inputs to `zerodp train` and
`zerodp consolidate` (options, config files, config values, checkpoint and run folders). Each is
refused before any rank starts, with exit code 2, one line on stderr naming the problem and the
fix, no traceback, and every file already saved byte-for-byte unchanged.

The saved run all cases start from is a real one: `zerodp train` run in this process as a world of
one rank (torchrun's variables set), 2 steps of the tiny GPT.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest

from zerodp.tools import cli

TINY = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved") / "run"
    with pytest.MonkeyPatch.context() as mp:
        for var, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())).items():
            mp.setenv(var, value)
        assert cli.main(["train", *TINY, "--stage", "1", "--steps", "2", "--save-every", "0", "--out", str(out)]) == 0
    assert (out / "checkpoints" / "global_step2" / "meta.json").is_file()
    return out


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (the "nothing saved was damaged" check)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def write(path: Path, text) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# Each case: (id, setup(tmp, run) -> argv, text the one line must contain). `run` is a private copy of
# the saved run; `setup` may damage it first (what the user did), then digest() pins it.
CASES = [
    # -- options
    ("model", lambda t, r: ["train", "--model", "huge"], "invalid choice"),
    ("stage", lambda t, r: ["train", "--stage", "5"], "invalid choice"),
    ("steps-text", lambda t, r: ["train", "--steps", "ten"], "invalid int value"),
    ("steps-zero", lambda t, r: ["train", *TINY, "--steps", "0", "--out", str(t / "o")], "at least 1"),
    ("log-every", lambda t, r: ["train", *TINY, "--log-every", "0", "--out", str(t / "o")], "at least 1"),
    ("lr-negative", lambda t, r: ["train", *TINY, "--lr", "-1", "--out", str(t / "o")], "positive finite"),
    ("lr-inf", lambda t, r: ["train", *TINY, "--lr", "inf", "--out", str(t / "o")], "positive finite"),
    ("lr-nan", lambda t, r: ["train", *TINY, "--lr", "nan", "--out", str(t / "o")], "positive finite"),
    ("seq-len", lambda t, r: ["train", *TINY[:4], "--seq-len", "999", "--out", str(t / "o")], "block_size"),
    ("nproc", lambda t, r: ["train", *TINY, "--nproc", "0", "--out", str(t / "o")], "--nproc must be at least 1"),
    ("micro-batch", lambda t, r: ["train", "--model", "tiny", "--micro-batch", "0", "--out", str(t / "o")],
     "train_micro_batch_size_per_gpu"),
    ("save-every", lambda t, r: ["train", *TINY, "--save-every", "-1", "--out", str(t / "o")], "at least 0"),
    ("max-restarts", lambda t, r: ["train", *TINY, "--max-restarts", "-2", "--out", str(t / "o")], "at least 0"),
    ("tag-without-resume", lambda t, r: ["train", *TINY, "--tag", "x", "--out", str(t / "o")], "needs --resume"),
    ("out-reused", lambda t, r: ["train", *TINY, "--out", str(r)], "--overwrite"),
    ("out-reused-by-other-resume", lambda t, r: ["train", "--resume", str(r), "--out", str(_second_run(t, r))],
     "already holds a run"),
    ("out-not-writable", lambda t, r: ["train", *TINY, "--out", str(write(t / "file", "x") / "sub")],
     "cannot write"),
    # -- config files
    ("config-missing", lambda t, r: ["train", "--config", str(t / "none.json")], "does not exist"),
    ("config-empty-json", lambda t, r: ["train", "--config", str(write(t / "c.json", ""))], "is empty"),
    ("config-invalid-json", lambda t, r: ["train", "--config", str(write(t / "c.json", '{"a": 1,}'))],
     "c.json:1:9: invalid JSON"),
    ("config-truncated-json", lambda t, r: ["train", "--config",
                                            str(write(t / "c.json", '{\n "zero_optimization": {"stage": 2'))],
     "c.json:2:34: invalid JSON"),
    ("config-yaml-tab", lambda t, r: ["train", "--config", str(write(t / "c.yaml", "bf16:\n\tenabled: true\n"))],
     "c.yaml:2:1: invalid YAML"),
    ("config-yaml-list", lambda t, r: ["train", "--config", str(write(t / "c.yaml", "- 1\n"))], "mapping"),
    ("config-suffix", lambda t, r: ["train", "--config", str(write(t / "c.txt", "{}"))], "use .json, .yaml"),
    ("config-not-utf8", lambda t, r: ["train", "--config", str(write(t / "c.json", b"\xff\xfe{}"))], "UTF-8"),
    # -- config values
    ("config-unknown-key", lambda t, r: ["train", "--config", str(write(t / "c.json", '{"zero_optimization": '
                                                                        '{"stag": 2}}'))], "did you mean 'stage'"),
    ("config-negative-clipping", lambda t, r: ["train", "--config", str(write(t / "c.json",
                                                                              '{"gradient_clipping": -1}'))],
     "gradient_clipping"),
    ("config-both-precisions", lambda t, r: ["train", "--config", str(write(
        t / "c.json", '{"fp16": {"enabled": true}, "bf16": {"enabled": true}}'))], "enable at most one"),
    ("config-batch", lambda t, r: ["train", "--config", str(write(t / "c.json", '{"train_batch_size": 7}'))],
     "train_batch_size=7"),
    ("config-negative-lr", lambda t, r: ["train", "--config", str(write(
        t / "c.json", '{"optimizer": {"type": "AdamW", "params": {"lr": -1}}}'))], "fix optimizer.params"),
    ("config-nan-lr", lambda t, r: ["train", "--config", str(write(
        t / "c.json", '{"optimizer": {"type": "AdamW", "params": {"lr": NaN}}}'))], "fix optimizer.params"),
    # -- checkpoint and run folders
    ("resume-missing", lambda t, r: ["train", "--resume", str(t / "nothing")], "no such directory"),
    ("resume-empty-folder", lambda t, r: ["train", "--resume", str(_mkdir(t / "empty"))],
     "not a zerodp checkpoint directory"),
    ("resume-latest-deleted", lambda t, r: ["train", "--resume", str(_unlink(r / "checkpoints" / "latest"))],
     "--tag T"),
    ("resume-tag-unknown", lambda t, r: ["train", "--resume", str(r), "--tag", "global_step99"],
     "available tags: global_step2"),
    ("resume-tag-invalid", lambda t, r: ["train", "--resume", str(r), "--tag", "../x"], "invalid checkpoint tag"),
    ("resume-meta-truncated", lambda t, r: ["train", "--resume", str(_truncate(
        r / "checkpoints" / "global_step2" / "meta.json"))], "truncated"),
    ("resume-run-json-truncated", lambda t, r: ["train", "--resume", str(_truncate(r / "run.json"))],
     "run.json:"),
    ("consolidate-latest-deleted", lambda t, r: ["consolidate", str(_unlink(r / "checkpoints" / "latest") /
                                                                     "checkpoints"), str(t / "m.safetensors")],
     "--tag T"),
    ("consolidate-tag-unknown", lambda t, r: ["consolidate", str(r / "checkpoints"), str(t / "m.safetensors"),
                                              "--tag", "nope"], "available tags"),
]


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _unlink(path: Path) -> Path:
    """Delete `path`; returns the run folder it was in (its checkpoints/ parent)."""
    path.unlink()
    return path.parents[1]


def _truncate(path: Path) -> Path:
    """Cut `path` in half; returns the run folder holding it."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return next(p for p in path.parents if (p / "checkpoints").is_dir())


def _second_run(tmp: Path, run: Path) -> Path:
    other = tmp / "other"
    shutil.copytree(run, other)
    return other


def test_the_table_is_large_enough():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, setup, needle", CASES, ids=[c[0] for c in CASES])
def test_user_mistake_is_one_line_and_exit_2(name, setup, needle, saved_run, tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    argv = setup(tmp_path, run)
    before = digest(tmp_path)
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    _, err = capsys.readouterr()
    assert code == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    after = digest(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before, "a refused command changed saved files"
    assert not any(k.startswith("run/") for k in set(after) - set(before)), "a refused command wrote into the run"


def test_saved_run_resumes_after_the_refusals(saved_run):
    """The fixture's run is intact and its settings are what the cases relied on."""
    saved = json.loads((saved_run / "run.json").read_text())
    assert saved["args"]["model"] == "tiny" and saved["args"]["steps"] == 2
