"""The watchdog on backends whose wait does not block the host (NCCL): a collective that never completes
on the device is named with its step, phase and unit ([Note: waits that do not block the host] in
comm/group.py). On CPU: the logic as data (`find_stalled` with probes), the handle's choice by backend, and a
fake in-flight collective that never completes ending a child process with the watchdog's report."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from zerodp.comm import collectives, group, watchdog


def _entry(what: str = "blocks.1") -> watchdog.Entry:
    return watchdog.Entry(1, "all_gather", "param", 1024, "bfloat16", "world", what, "global step 4, phase forward")


def test_a_probe_still_false_after_the_timeout_is_stalled_and_done_ones_are_dropped():
    done, stuck = _entry("done"), _entry("stuck")
    in_flight = [(100.0, done, lambda: True), (100.0, stuck, lambda: False)]
    found, pending = watchdog.find_stalled(105.0, 10.0, [], in_flight)
    assert found is None and [e for _, e, _ in pending] == [stuck]  # not yet: 5 s of 10
    found, pending = watchdog.find_stalled(111.0, 10.0, [], pending)
    assert found == (100.0, stuck)


def test_the_oldest_stall_is_reported_whether_a_host_wait_or_a_device_collective():
    host, device = _entry("host"), _entry("device")
    found, _ = watchdog.find_stalled(200.0, 10.0, [(150.0, host)], [(120.0, device, lambda: False)])
    assert found == (120.0, device)


def test_only_nccl_waits_are_tracked_on_the_device(monkeypatch):
    assert group.wait_blocks_host("gloo") and group.wait_blocks_host("mpi") and not group.wait_blocks_host("nccl")

    class Work:
        def wait(self):  # NCCL's returns at once: it only orders the current stream
            return True

    tracked = []
    monkeypatch.setattr(collectives, "_stream_probe", lambda: (lambda: False))
    monkeypatch.setattr(watchdog, "track", lambda entry, probe: tracked.append((entry, probe())))
    entry = _entry()
    collectives.Handle(Work(), None, entry, blocks_host=False).wait()
    assert tracked == [(entry, False)]
    collectives.Handle(Work(), None, _entry(), blocks_host=True).wait()  # gloo: the wait itself is watched
    assert len(tracked) == 1


@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_a_collective_that_never_completes_on_the_device_ends_the_process_with_its_step_phase_and_unit():
    child = textwrap.dedent("""
        import time
        from zerodp.comm import watchdog
        watchdog.apply(watchdog.Settings(timeout_s=0.3, debug_sync=False, rank=1))
        activity = watchdog.activity()
        activity.global_step, activity.micro_step = 4, 8
        activity.enter("forward")
        activity.unit = "blocks.1"
        entry = watchdog.issue("all_gather", "param", 1024, "torch.bfloat16", "world", "blocks.1")
        watchdog.track(entry, lambda: False)   # an NCCL work whose CUDA event never completes
        time.sleep(30)
        print("the watchdog did not fire")
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == watchdog.EXIT_CODE, proc.stdout + proc.stderr
    err = proc.stderr
    assert "zerodp rank 1: waited" in err and "(comm_timeout_s=0.3) for the device to complete collective" in err, err
    assert "global step 4, micro-step 8, phase forward, unit 'blocks.1'" in err, err
    assert "all_gather of blocks.1 (tag 'param', numel 1024, bfloat16, group world) [in flight]" in err, err


def test_a_tracked_collective_is_marked_done_once_its_probe_says_so():
    previous = watchdog.apply(watchdog.Settings(timeout_s=600.0, debug_sync=False, rank=0))
    entry, completed = _entry(), []
    try:
        watchdog.track(entry, lambda: bool(completed))
        assert entry.state == "in flight"
        completed.append(True)
        deadline = time.monotonic() + 30
        while entry.state != "done" and time.monotonic() < deadline:
            time.sleep(0.05)  # the watchdog thread polls once a second
        assert entry.state == "done"
    finally:
        watchdog.stop()
        watchdog.apply(previous)
