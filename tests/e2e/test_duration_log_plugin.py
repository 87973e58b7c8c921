"""The duration log as `make test` loads it (`-p tests.duration_log --duration-log FILE`), in a child pytest
over a small test file: one CSV row per test with its outcome, the summary at the end, and the command over
the file that .ci/run calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.duration_log import read_log

ROOT = Path(__file__).resolve().parents[2]


def test_the_plugin_writes_a_row_per_test(tmp_path: Path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest, time\n"
        "def test_ok(): time.sleep(0.2)\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.skip(reason='x')\n"
        "def test_skipped(): pass\n"
        "@pytest.fixture\n"
        "def broken_teardown():\n"
        "    yield\n"
        "    raise RuntimeError('teardown')\n"
        "def test_teardown_error(broken_teardown): pass\n"
        "@pytest.mark.slow\n"
        "def test_marked(): pass\n")
    (tmp_path / "conftest.py").write_text("def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'slow: long')\n")
    log = tmp_path / "durations" / "run.csv"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.duration_log",
                           "--duration-log", str(log), "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_fails and the teardown error
    rows = {r.nodeid.split("::")[-1]: r for r in read_log(log)}
    assert {k: r.outcome for k, r in rows.items()} == {"test_ok": "passed", "test_fails": "failed",
                                                       "test_skipped": "skipped", "test_teardown_error": "failed",
                                                       "test_marked": "passed"}
    assert rows["test_marked"].slow and not rows["test_ok"].slow
    assert 0.2 <= rows["test_ok"].duration_s < 30 and rows["test_ok"].cpu_s >= 0
    assert "durations:" in proc.stdout and "the 5 slowest" in proc.stdout and "rule: no test" in proc.stdout
    main = subprocess.run([sys.executable, "-m", "tests.duration_log", "--slowest", "1", "--check", str(log)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert main.returncode == 0 and "test_sample.py::test_ok" in main.stdout.splitlines()[2], main.stdout
