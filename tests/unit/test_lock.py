"""requirements/lock.txt (README, "Two commands"): every dependency pyproject.toml names, core and every
extra, is pinned there, and the environment the suite runs in is the locked one (`make setup` installs
the lock as constraints), so what passes here is what a fresh machine gets."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"lock.txt: {line!r} is not pinned with =="
            pins[_name(name)] = version
    return pins


def test_every_declared_dependency_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    missing = sorted({_name(r) for r in declared} - set(_lock()))
    assert not missing, f"pyproject.toml names {missing}, which requirements/lock.txt does not pin (run make lock)"


def test_the_suite_runs_in_the_locked_environment():
    wrong = {}
    for name, version in _lock().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # pip itself outside a venv, say; the declared ones are checked above
        if installed.split("+")[0] != version:
            wrong[name] = (installed, version)
    assert not wrong, f"installed vs locked: {wrong}; run make setup (or make lock to upgrade deliberately)"
