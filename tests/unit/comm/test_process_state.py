"""comm keeps no module state (issue 43): what it remembers between calls is one `CommState` (comm/process_state.py)
that the engine's Runtime owns. These tests fail when a module global creeps back into comm (or a new one appears
anywhere in zerodp), or when installing another CommState leaves anything of the first in force."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zerodp.comm import process_state, watchdog
from zerodp.engine.runtime import RUNTIME

COMM = Path(__file__).resolve().parents[3] / "src" / "zerodp" / "comm"
MUTABLE_CALLS = {"list", "dict", "set", "deque", "defaultdict"}


def _module_state(path: Path) -> list[str]:
    """`global` statements and module-level names bound to a mutable container or an object (a call of a class:
    `activity = Activity()`); names in CAPITALS are constants: tables read, never written."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{path.name}:{node.lineno}: global {', '.join(node.names)}")
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        value = getattr(node, "value", None)
        names = [t.id for t in targets if isinstance(t, ast.Name) and not t.id.isupper()
                 and not t.id.startswith("__")]
        call = value.func if isinstance(value, ast.Call) else None
        called = getattr(call, "id", None) or getattr(call, "attr", None)
        if names and (isinstance(value, (ast.List, ast.Dict, ast.Set)) or called in MUTABLE_CALLS
                      or (called or "a")[0].isupper()):
            found.append(f"{path.name}:{node.lineno}: {', '.join(names)}")
    return found


def test_comm_has_no_module_state_but_the_installed_pointer():
    found = [hit.split(":", 2)[::2] for path in sorted(COMM.glob("*.py")) for hit in _module_state(path)]
    assert found == [["process_state.py", " global installed"]], (
        "module state in zerodp.comm: keep it in CommState (comm/process_state.py), which the Runtime owns")


def test_the_process_state_outside_the_runtime_is_the_listed_few():
    """Every `global` statement and module-level mutable name in zerodp, beside the Runtime's CommState: each kept on
    purpose, with a why-comment where it is defined. A new one fails here: put it in the Runtime (or say why not).
    Names in CAPITALS are not counted: tables, and the two process objects by name (engine/runtime.py's RUNTIME,
    activations' PROCESS, which the Runtime's leases drive)."""
    root = COMM.parent
    found = sorted(f"{path.relative_to(root).parent}/{hit.split(':')[0]}:{hit.split(':', 2)[2].strip()}"
                   for path in root.rglob("*.py") for hit in _module_state(path))
    assert found == [
        "./host_memory.py:global _mapped_threshold",  # mirrors glibc's one allocator setting per process
        "./host_memory.py:global _mapped_threshold",
        "adapters/deepspeed/accelerator.py:global _ACCELERATOR",  # DeepSpeed's API: one accelerator per process
        "adapters/deepspeed/accelerator.py:global _ACCELERATOR",
        "comm/process_state.py:global installed",  # the Runtime's CommState, installed
        "offload/tier.py:_reported",  # warn-once lines, as Python's warnings registry
    ], found


def test_the_guard_sees_a_module_global(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("_seen = []\nTABLE = {}\nactivity = Activity()\nlog = logging.getLogger('x')\n\n"
                      "def f():\n    global _n\n")
    assert _module_state(sample) == ["sample.py:7: global _n", "sample.py:1: _seen", "sample.py:3: activity"]


def test_importing_zerodp_installs_the_runtimes_state():
    assert process_state.current() is RUNTIME.comm


def test_a_fresh_state_shares_nothing_with_the_one_it_replaces():
    process = process_state.current()
    process.warned.add("seen")
    fresh = process_state.CommState(watchdog.Watchdog())
    previous = process_state.install(fresh)
    try:
        assert previous is process
        assert watchdog.recent() == [] and watchdog.settings() == watchdog.Settings.resolve()
        entry = watchdog.issue("broadcast", "param", 1, "float32", "world")
        assert fresh.watchdog.recorder[-1] is entry and entry not in process.watchdog.recorder
        assert fresh.warned == set() and fresh.hosts is None and fresh.local_pool is None
        assert fresh.elastic_attempt is None and fresh.created_group is None and fresh.groups_created == 0
    finally:
        process_state.install(process)
        process.warned.discard("seen")


def test_comm_without_an_installed_state_says_so():
    previous = process_state.install(None)
    try:
        with pytest.raises(RuntimeError, match="no CommState installed"):
            watchdog.timeout_s()
    finally:
        process_state.install(previous)
