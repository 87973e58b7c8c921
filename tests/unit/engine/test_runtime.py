"""The Runtime (zerodp/engine/runtime.py): process-wide settings are taken by each engine's lease, the running
engine's (else the newest) in force, given back in any order, and the last lease out restores the process. comm's
state lives in the Runtime's CommState (comm/process_state.py): each test installs a fresh Runtime's and puts the
process's back, so nothing leaks between tests. No process group: the group's ownership is stood in for by
monkeypatching `comm.owns_default_group` / `comm.destroy_distributed`."""

from __future__ import annotations

import gc

import pytest

import torch
import torch.nn.functional as F

from zerodp import comm, host_memory
from zerodp.comm import collectives, process_state, watchdog
from zerodp.config import load_config
from zerodp.engine.runtime import RUNTIME, Runtime
from zerodp.engine.zero_engine import ZeroEngine


def _config(timeout_s: float, debug_sync: bool = False):
    return load_config({"comm_timeout_s": timeout_s, "zero_optimization": {"debug_sync": debug_sync}})


@pytest.fixture
def destroyed(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(comm, "owns_default_group", lambda: True)
    monkeypatch.setattr(comm, "destroy_distributed", lambda: calls.append("destroyed"))
    monkeypatch.delenv("ZERODP_COMM_TIMEOUT_S", raising=False)
    monkeypatch.delenv("ZERODP_DEBUG_SYNC", raising=False)
    return calls


@pytest.fixture(autouse=True)
def runtime():
    """A fresh Runtime whose CommState comm uses for the test; the process's comes back after."""
    fresh = Runtime()
    previous = fresh.install()
    try:
        yield fresh
    finally:
        process_state.install(previous)


def _in_force(state: process_state.CommState) -> tuple:
    """What is in force in comm's state (as comm's own functions read it), and the watchdog's thread and tracked
    collectives."""
    dog = state.watchdog
    return (watchdog.settings(), comm.issues_no_collectives(), watchdog.activity() is dog.activity,
            dog.thread is not None and dog.thread.is_alive(), len(dog.in_flight))


def test_newest_lease_rules_and_the_last_out_restores_the_process(destroyed, runtime):
    before = watchdog.settings()
    a = runtime.lease(_config(111.0), rank=0)
    b = runtime.lease(_config(222.0, debug_sync=True), rank=0)
    assert watchdog.timeout_s() == 222.0 and watchdog.debug_sync_enabled()
    a.close()  # the older engine goes first: the newer one's settings and group stay
    assert watchdog.timeout_s() == 222.0 and destroyed == []
    a.close()  # idempotent
    b.close()
    assert destroyed == ["destroyed"]  # the last engine on the default group zerodp created ends it
    assert watchdog.settings() == before and runtime.leases == []


def test_closing_the_newest_brings_back_the_older_engines_settings(destroyed, runtime):
    a = runtime.lease(_config(111.0), rank=0)
    b = runtime.lease(_config(222.0), rank=0)
    b.close()
    assert watchdog.timeout_s() == 111.0 and destroyed == []
    a.close()
    assert destroyed == ["destroyed"]


def test_an_engine_on_its_own_group_leaves_the_default_group_alone(destroyed, runtime):
    runtime.lease(_config(60.0), rank=0, process_group=object()).close()
    assert destroyed == []


def test_real_collectives_are_read_once_per_engine(destroyed, monkeypatch, runtime):
    monkeypatch.setenv(comm.REAL_COLLECTIVES_ENV, "1")
    lease = runtime.lease(_config(60.0), rank=0)
    monkeypatch.setenv(comm.REAL_COLLECTIVES_ENV, "0")  # a live engine keeps the decision it was built with
    assert runtime.comm.engine.real_collectives is True
    lease.close()
    assert runtime.comm.engine is None and runtime.comm.real_collectives is None  # the environment answers again


def test_an_engine_dropped_without_close_no_longer_counts(destroyed, runtime):
    class Engine:
        pass

    dropped = Engine()
    before = watchdog.settings()
    runtime.lease(_config(111.0), rank=0).held_by(dropped)
    del dropped
    gc.collect()
    kept = runtime.lease(_config(222.0), rank=0)  # the dropped engine's lease is forgotten here
    kept.close()  # this is the last one out
    assert runtime.leases == [] and destroyed == ["destroyed"]
    assert watchdog.settings() == before  # not the dropped engine's: the settings from before the first lease


def test_the_last_engine_out_restores_the_allocator(destroyed, runtime):
    if host_memory.libc_function("mallopt", ()) is None:
        pytest.skip("not glibc: no mallopt")
    first, second = runtime.lease(_config(60.0), rank=0), runtime.lease(_config(60.0), rank=0)
    assert host_memory.map_large_buffers()  # what an offload tier does when it is built
    first.close()
    assert host_memory.large_buffers_mapped() is not None  # the other engine may still offload
    second.close()
    assert host_memory.large_buffers_mapped() is None


def test_an_engines_checkpointing_section_is_given_back_by_the_last_engine_out(destroyed, runtime):
    """`activations.PROCESS` holds the newest live engine's `activation_checkpointing` section; the last engine out
    removes it, so a later `zerodp.activations.checkpoint` call runs with the defaults again (issue 43)."""
    from zerodp import activations
    from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig

    plain = activations.PROCESS.current().settings
    assert plain == ActivationCheckpointingConfig() and activations.PROCESS.checkpointer is None
    a = runtime.lease(load_config({"activation_checkpointing": {"cpu_checkpointing": True}}), rank=0, checkpointing=True)
    b = runtime.lease(load_config({"activation_checkpointing": {"profile": True}}), rank=0, checkpointing=True)
    assert activations.PROCESS.current().settings.profile  # the newest engine's
    b.close()
    assert activations.PROCESS.current().settings.cpu_checkpointing  # back to the live engine's
    assert not activations.PROCESS.current().settings.profile
    a.close()
    assert activations.PROCESS.checkpointer is None and activations.PROCESS.current().settings == plain


def test_a_configure_call_outlives_the_engines(destroyed, runtime):
    from zerodp import activations
    from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig

    configured = activations.PROCESS.configure(ActivationCheckpointingConfig(cpu_checkpointing=True))
    try:
        runtime.lease(load_config({"activation_checkpointing": {"profile": True}}), rank=0, checkpointing=True).close()
        assert activations.PROCESS.checkpointer is configured  # DeepSpeed's rule: configure() wins and stays
    finally:
        activations.PROCESS.checkpointer, activations.PROCESS.from_engine = None, False


def test_a_section_that_cannot_be_installed_takes_no_lease(destroyed, runtime):
    """partition_activations without an mpu is refused at the lease, and the process is left as it was: no lease
    held, no checkpointing installed, so the next engine starts clean (a failed build leaks nothing)."""
    from zerodp import activations

    bad = load_config({"activation_checkpointing": {"partition_activations": True}})
    with pytest.raises(ValueError, match="no model-parallel unit"):
        runtime.lease(bad, rank=0, checkpointing=True)
    assert runtime.leases == [] and activations.PROCESS.checkpointer is None
    runtime.lease(bad, rank=0).close()  # an engine built directly (not by initialize) does not install it


def test_a_lease_without_checkpointing_leaves_the_process_checkpointing_alone(destroyed, runtime):
    from zerodp import activations

    held = runtime.lease(load_config({"activation_checkpointing": {"profile": True}}), rank=0)
    assert activations.PROCESS.checkpointer is None
    held.close()


# -- comm's state lives in the Runtime (issue 43 point 3) ------------------------------------------------------


def test_comm_acts_on_the_installed_runtimes_state_only(runtime):
    """The fixture's fresh Runtime is the one comm reads and writes; the process's RUNTIME sees none of it."""
    assert process_state.current() is runtime.comm is not RUNTIME.comm
    seen = RUNTIME.comm.watchdog.seq
    entry = watchdog.issue("all_reduce", "norm", 1, "float32", "world")
    assert watchdog.recent() == [entry] and RUNTIME.comm.watchdog.seq == seen
    with comm.record() as log:
        comm.all_reduce(torch.ones(2), tag="norm").wait()  # one process: an identity, still recorded
    assert [r.op for r in log.records] == ["all_reduce"] and runtime.comm.logs == [] and RUNTIME.comm.logs == []


def test_after_the_last_engine_out_the_watchdog_and_collectives_are_as_before(destroyed, runtime, monkeypatch):
    """Two leases change the watchdog's settings, the activity, the world-size-1 decision and start the watchdog's
    thread; once both are closed, comm's state is exactly what it was before the first (nothing leaks)."""
    before = _in_force(runtime.comm)
    assert before == (watchdog.Settings.resolve(), True, True, False, 0) and runtime.comm.engine is None
    monkeypatch.setenv(comm.REAL_COLLECTIVES_ENV, "1")
    a = runtime.lease(_config(111.0, debug_sync=True), rank=0)
    b = runtime.lease(_config(222.0), rank=0)
    with watchdog.waiting(watchdog.issue("all_gather", "param", 8, "float32", "world")):  # starts the thread
        pass
    watchdog.track(watchdog.issue("all_gather", "param", 8, "float32", "world"), lambda: False)
    assert _in_force(runtime.comm) == (b.settings.watchdog, True, False, True, 1)  # no group: still identities
    assert runtime.comm.engine.real_collectives is True
    b.close()
    assert _in_force(runtime.comm)[:3] == (a.settings.watchdog, True, False)
    a.close()
    monkeypatch.delenv(comm.REAL_COLLECTIVES_ENV)
    assert _in_force(runtime.comm) == before
    assert runtime.comm.engine is None and runtime.leases == []


def test_two_engines_with_different_timeouts_each_see_their_own(destroyed, runtime):
    """While an engine runs a call its lease is in force: its comm_timeout_s, debug_sync and activity, stamped on
    every collective it issues; between calls the newest engine's; nested calls come back in order."""
    a, b = runtime.lease(_config(111.0), rank=0), runtime.lease(_config(222.0, debug_sync=True), rank=0)
    assert watchdog.timeout_s() == 222.0 and watchdog.activity() is b.comm.activity  # between calls: the newest
    with a.in_force():
        assert watchdog.timeout_s() == 111.0 and not watchdog.debug_sync_enabled()
        assert watchdog.activity() is a.comm.activity
        from_a = watchdog.issue("all_reduce", "grad", 4, "float32", "world")
        with b.in_force():  # an engine called from inside another's call
            from_b = watchdog.issue("all_reduce", "grad", 4, "float32", "world")
            assert watchdog.debug_sync_enabled()
        assert watchdog.timeout_s() == 111.0  # back to the outer engine's
        with b.in_force():
            with a.in_force():  # A inside B inside A: each exit brings back the one around it
                assert watchdog.timeout_s() == 111.0
            assert watchdog.timeout_s() == 222.0
        assert watchdog.timeout_s() == 111.0
    assert (from_a.timeout_s, from_b.timeout_s) == (111.0, 222.0)
    assert watchdog.timeout_s() == 222.0  # between calls: the newest again
    b.close()
    assert watchdog.timeout_s() == 111.0  # the one left
    a.close()


def test_the_watchdog_holds_each_collective_to_its_own_timeout():
    """A wait of engine A (timeout 10 s) is stalled after 50 s while one of engine B (100 s) is not."""
    def entry(timeout_s):
        return watchdog.Entry(1, "all_gather", "param", 8, "float32", "world", "", "",
                              settings=watchdog.Settings(timeout_s, False, 0))

    short, long_ = entry(10.0), entry(100.0)
    found, _ = watchdog.find_stalled(150.0, 600.0, [(100.0, long_), (100.0, short)], [])
    assert found == (100.0, short)
    found, _ = watchdog.find_stalled(150.0, 600.0, [(100.0, long_)], [(100.0, long_, lambda: False)])
    assert found is None


def test_engines_stepped_side_by_side_each_run_under_their_own_settings(runtime):
    """Two real engines (one rank, no process group): inside each one's forward the watchdog reads that engine's
    comm_timeout_s and activity, whatever was built last; closing both leaves comm's state as it was."""
    before = _in_force(runtime.comm)

    class Probe(torch.nn.Linear):
        def forward(self, x):
            self.seen = (watchdog.timeout_s(), watchdog.activity().phase)
            return super().forward(x)

    def build(timeout_s):
        torch.manual_seed(0)
        model = Probe(3, 2)
        config = load_config({"train_micro_batch_size_per_gpu": 2, "comm_timeout_s": timeout_s,
                              "zero_optimization": {"stage": 2}})
        # the engine leases from the test's Runtime (initialize leases from the process's RUNTIME)
        return model, ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config,
                                 lease=runtime.lease(config, rank=0))

    (model_a, a), (model_b, b) = build(111.0), build(222.0)
    for engine, model, timeout_s in ((a, model_a, 111.0), (b, model_b, 222.0), (a, model_a, 111.0)):
        engine.backward(F.mse_loss(engine(torch.ones(2, 3)), torch.zeros(2, 2)))
        engine.step()
        assert model.seen == (timeout_s, "forward")
    assert a._lease.comm.activity.global_step == 2 and b._lease.comm.activity.global_step == 1  # each engine's own count
    a.close()
    b.close()
    assert _in_force(runtime.comm) == before and not collectives.observers()
