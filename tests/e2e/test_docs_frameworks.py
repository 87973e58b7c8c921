"""docs/frameworks.md's promises: its example prints what the page shows, and its commands are the ones the
framework tests run (tests/e2e/test_lightning.py and test_accelerate_launch.py build their command lines from
this page with `documented`, putting their own script in place of `train.py`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from _zerodp_deepspeed_alias import ENV

DOC = Path(__file__).resolve().parents[2] / "docs" / "frameworks.md"


def _blocks() -> list[list[str]]:
    """The ```$ ...``` blocks of the page: the command line, then the lines it prints."""
    return [block.strip().splitlines() for block in re.findall(r"```\n(\$ .*?)```", DOC.read_text(), re.S)]


def documented(program: str, script: Path, *script_args: str, launcher_args: tuple = ()) -> tuple[list[str], dict]:
    """The page's command running `program` (`python`, `accelerate`, `torchrun`), as (argv, environment): the
    page's `NAME=VALUE` prefix in the environment, this interpreter's `program`, `script` for `train.py`, and
    `launcher_args` right after the launcher's own arguments begin (`accelerate launch <here> ...`)."""
    for block in _blocks():
        words = shlex.split(block[0][2:])
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
        words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
        if words[0] != program or "train.py" not in words:
            continue
        at = words.index("train.py")
        head = [sys.executable] if program == "python" else [str(Path(sys.executable).parent / program)]
        cut = 2 if program == "accelerate" else 1  # after `accelerate launch`
        argv = head + words[1:cut] + list(launcher_args) + words[cut:at] + [str(script), *script_args]
        return argv, env
    raise AssertionError(f"docs/frameworks.md shows no `{program} ... train.py` command")


def test_the_switch_example_prints_what_the_page_shows():
    (command, *shown), = [b for b in _blocks() if "import deepspeed" in b[0]]
    words = shlex.split(command[2:])
    assert words[0] == f"{ENV}=1" and words[1] == "python", "the page's switch is not the one the hook reads"
    env = {**{k: v for k, v in os.environ.items() if k != ENV}, ENV: "1"}
    out = subprocess.run([sys.executable, *words[2:]], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == shown


def test_every_framework_command_is_built_by_a_test():
    programs = [shlex.split(b[0][2:]) for b in _blocks()]
    launchers = sorted({next(w for w in words if "=" not in w) for words in programs})
    assert launchers == ["accelerate", "python", "torchrun"]
    tests = {p.name: p.read_text() for p in Path(__file__).parent.glob("test_*.py")}
    assert 'documented("python"' in tests["test_lightning.py"]
    assert 'documented("accelerate"' in tests["test_accelerate_launch.py"]
