"""tests/duration_log.py's 30-second rule and report (issue 43); the plugin itself, in a child pytest, is
tests/e2e/test_duration_log_plugin.py."""

from __future__ import annotations

from tests.duration_log import RULE_SECONDS, DurationRow, report_lines


def test_the_rule_names_long_unmarked_tests_outside_e2e():
    long = RULE_SECONDS + 1
    rows = [DurationRow("tests/unit/test_a.py::test_long", long, 1.0, "passed", False),
            DurationRow("tests/unit/test_a.py::test_long_slow", long, 1.0, "passed", True),
            DurationRow("tests/e2e/test_b.py::test_long_e2e", long, 1.0, "failed", False),
            DurationRow("tests/dist/test_c.py::test_skipped", long, 0.0, "skipped", False),
            DurationRow("tests/dist/test_c.py::test_quick", RULE_SECONDS - 1, 1.0, "passed", False)]
    assert [r.nodeid for r in rows if r.breaks_rule()] == ["tests/unit/test_a.py::test_long"]
    lines = report_lines(rows, slowest=2, check=True)
    assert lines[0].startswith("5 tests,") and len([l for l in lines if "::" in l]) == 2 + 1
    assert any(l.startswith("RULE: 1 test(s)") for l in lines) and lines[-1].endswith("tests/unit/test_a.py::test_long")
    assert report_lines(rows[1:], check=True)[-1].startswith("rule: no test")
