"""Every test's duration, written where CI keeps it, and the 30-second rule (issue 43).

A pytest plugin, loaded by the Makefile's test targets (`-p tests.duration_log --duration-log FILE`): one CSV
row per test, in the order the tests ran,

    nodeid,duration_s,cpu_s,outcome,slow

`duration_s` is wall time over setup, call and teardown (a module fixture that spawns ranks counts in its first
test's setup, where it is paid); `cpu_s` is this process's CPU time over the same phases plus that of the child
processes it reaped meanwhile: on a shared, loaded machine wall time inflates and CPU time mostly does not, so
`cpu_s` is the better guess at an idle machine's wall time for in-process tests. The session's summary ends
with the ten slowest tests and the rule's report.

The rule: a test of the default run (`make test`) that takes over RULE_SECONDS is marked `slow` (and so runs in
`make test-slow` only) or lives in tests/e2e/ (end-to-end runs are slow by nature). A breach is reported, by
name, in the summary and by `.ci/run`; it does not fail the suite, because one loaded run of a 25-second test
must not turn CI red (a breach seen on a quiet machine is a real one: mark or speed up the test).

Also a command over the files written: `python -m tests.duration_log [--slowest N] [--check] FILE...` prints
the N slowest tests of all the files together and, with --check, the rule's breaches.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RULE_SECONDS = 30.0
SLOW_OK_FOLDERS = ("tests/e2e/",)  # end-to-end runs may take longer than RULE_SECONDS
FIELDS = ("nodeid", "duration_s", "cpu_s", "outcome", "slow")


@dataclass
class DurationRow:
    nodeid: str
    duration_s: float
    cpu_s: float
    outcome: str  # passed | failed | skipped
    slow: bool  # marked `slow`

    def breaks_rule(self) -> bool:
        return (self.duration_s > RULE_SECONDS and not self.slow and self.outcome != "skipped"
                and not self.nodeid.startswith(SLOW_OK_FOLDERS))


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser):
    parser.addoption("--duration-log", metavar="FILE", default=None,
                     help="write every test's wall and CPU seconds and outcome to FILE (CSV), and end with the "
                          f"ten slowest tests and the {RULE_SECONDS:.0f}-second rule's report")


def pytest_configure(config):
    path = config.getoption("--duration-log")
    if path:
        config.pluginmanager.register(DurationLog(Path(path)), "duration_log_writer")


class DurationLog:
    """Times each test from its setup's start to its teardown's end and appends its row as it finishes."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[DurationRow] = []
        self._start: tuple[float, float] | None = None
        self._outcome: dict[str, str] = {}  # nodeid -> the worst outcome of its phases so far
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            csv.writer(f).writerow(FIELDS)

    def pytest_runtest_logstart(self, nodeid, location):
        self._start = (time.perf_counter(), _cpu_seconds())

    def pytest_runtest_logreport(self, report):
        worst = self._outcome.get(report.nodeid, "passed")
        if report.failed:
            worst = "failed"
        elif report.skipped and worst == "passed":
            worst = "skipped"
        self._outcome[report.nodeid] = worst
        if report.when != "teardown":
            return
        wall0, cpu0 = self._start or (time.perf_counter(), _cpu_seconds())
        row = DurationRow(report.nodeid, round(time.perf_counter() - wall0, 3), round(_cpu_seconds() - cpu0, 3),
                           self._outcome.pop(report.nodeid), "slow" in report.keywords)
        self.rows.append(row)
        with self.path.open("a", newline="") as f:  # row by row: a run killed midway still leaves its rows
            csv.writer(f).writerow([row.nodeid, row.duration_s, row.cpu_s, row.outcome, int(row.slow)])

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        terminalreporter.section(f"durations: {self.path}")
        for line in report_lines(self.rows, slowest=10, check=True):
            write(line)


def report_lines(rows: list[DurationRow], slowest: int = 10, check: bool = True) -> list[str]:
    """The `slowest` slowest tests by wall time, then (with `check`) the rule's breaches or that there are none."""
    total = sum(r.duration_s for r in rows)
    cpu = sum(r.cpu_s for r in rows)
    out = [f"{len(rows)} tests, {total:.1f} s of wall time, {cpu:.1f} s of CPU time (this process and its children)"]
    out.append(f"the {min(slowest, len(rows))} slowest (wall s, cpu s, outcome):")
    for r in sorted(rows, key=lambda r: -r.duration_s)[:slowest]:
        out.append(f"  {r.duration_s:8.2f} {r.cpu_s:8.2f}  {r.outcome:7}  {r.nodeid}")
    if check:
        breaches = [r for r in rows if r.breaks_rule()]
        if breaches:
            out.append(f"RULE: {len(breaches)} test(s) over {RULE_SECONDS:.0f} s are neither marked `slow` nor in "
                       f"{', '.join(SLOW_OK_FOLDERS)} (mark them, move them or make them faster; on a loaded "
                       "machine, check the CPU seconds first):")
            out += [f"  {r.duration_s:8.2f} {r.cpu_s:8.2f}  {r.nodeid}" for r in breaches]
        else:
            out.append(f"rule: no test outside {', '.join(SLOW_OK_FOLDERS)} took over {RULE_SECONDS:.0f} s "
                       "unmarked")
    return out


def read_log(path: Path) -> list[DurationRow]:
    with path.open(newline="") as f:
        return [DurationRow(r["nodeid"], float(r["duration_s"]), float(r["cpu_s"]), r["outcome"], r["slow"] == "1")
                for r in csv.DictReader(f)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.duration_log", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="CSV files written by --duration-log")
    parser.add_argument("--slowest", type=int, default=10, help="how many of the slowest tests to print")
    parser.add_argument("--check", action="store_true", help=f"report tests over {RULE_SECONDS:.0f} s unmarked")
    args = parser.parse_args(argv)
    rows = []
    for path in args.files:
        if not path.exists():
            print(f"{path}: no such duration log (did the test run write it?)", file=sys.stderr)
            return 2
        rows += read_log(path)
    for line in report_lines(rows, args.slowest, args.check):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
