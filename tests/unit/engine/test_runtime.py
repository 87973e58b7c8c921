"""The Runtime (zerodp/engine/runtime.py): process-wide settings are taken by each engine's lease, the newest in
force, given back in any order, and the last lease out restores the process. No process group: the group's
ownership is stood in for by monkeypatching `comm.owns_default_group` / `comm.destroy_distributed`."""

from __future__ import annotations

import gc

import pytest

from zerodp import comm, host_memory
from zerodp.comm import group, watchdog
from zerodp.config import load_config
from zerodp.engine.runtime import Runtime


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


def test_newest_lease_rules_and_the_last_out_restores_the_process(destroyed):
    runtime, before = Runtime(), watchdog.settings()
    a = runtime.lease(_config(111.0), rank=0)
    b = runtime.lease(_config(222.0, debug_sync=True), rank=0)
    assert watchdog.timeout_s() == 222.0 and watchdog.debug_sync_enabled()
    a.close()  # the older engine goes first: the newer one's settings and group stay
    assert watchdog.timeout_s() == 222.0 and destroyed == []
    a.close()  # idempotent
    b.close()
    assert destroyed == ["destroyed"]  # the last engine on the default group zerodp created ends it
    assert watchdog.settings() == before and runtime.leases == []


def test_closing_the_newest_brings_back_the_older_engines_settings(destroyed):
    runtime = Runtime()
    a = runtime.lease(_config(111.0), rank=0)
    b = runtime.lease(_config(222.0), rank=0)
    b.close()
    assert watchdog.timeout_s() == 111.0 and destroyed == []
    a.close()
    assert destroyed == ["destroyed"]


def test_an_engine_on_its_own_group_leaves_the_default_group_alone(destroyed):
    runtime = Runtime()
    runtime.lease(_config(60.0), rank=0, process_group=object()).close()
    assert destroyed == []


def test_real_collectives_are_read_once_per_engine(destroyed, monkeypatch):
    runtime, before = Runtime(), group._real_collectives  # another test's engine may still hold a decision
    monkeypatch.setenv(comm.REAL_COLLECTIVES_ENV, "1")
    lease = runtime.lease(_config(60.0), rank=0)
    monkeypatch.setenv(comm.REAL_COLLECTIVES_ENV, "0")  # a live engine keeps the decision it was built with
    assert group._real_collectives is True
    lease.close()
    assert group._real_collectives is before  # the decision from before this engine is back


def test_an_engine_dropped_without_close_no_longer_counts(destroyed):
    class Engine:
        pass

    runtime = Runtime()
    dropped = Engine()
    runtime.lease(_config(111.0), rank=0).held_by(dropped)
    kept = runtime.lease(_config(222.0), rank=0)
    del dropped
    gc.collect()
    kept.close()  # the dropped engine's lease is forgotten: this is the last one out
    assert runtime.leases == [] and destroyed == ["destroyed"]


def test_the_last_engine_out_restores_the_allocator(destroyed):
    if host_memory.libc_function("mallopt", ()) is None:
        pytest.skip("not glibc: no mallopt")
    runtime = Runtime()
    first, second = runtime.lease(_config(60.0), rank=0), runtime.lease(_config(60.0), rank=0)
    assert host_memory.map_large_buffers()  # what an offload tier does when it is built
    first.close()
    assert host_memory.large_buffers_mapped() is not None  # the other engine may still offload
    second.close()
    assert host_memory.large_buffers_mapped() is None


def test_an_engines_checkpointing_section_is_given_back_by_the_last_engine_out(destroyed):
    """`activations.PROCESS` holds the newest live engine's `activation_checkpointing` section; the last engine out
    removes it, so a later `zerodp.activations.checkpoint` call runs with the defaults again (issue 43)."""
    from zerodp import activations
    from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig

    runtime = Runtime()
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


def test_a_configure_call_outlives_the_engines(destroyed):
    from zerodp import activations
    from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig

    runtime = Runtime()
    configured = activations.PROCESS.configure(ActivationCheckpointingConfig(cpu_checkpointing=True))
    try:
        runtime.lease(load_config({"activation_checkpointing": {"profile": True}}), rank=0, checkpointing=True).close()
        assert activations.PROCESS.checkpointer is configured  # DeepSpeed's rule: configure() wins and stays
    finally:
        activations.PROCESS.checkpointer, activations.PROCESS.from_engine = None, False


def test_a_section_that_cannot_be_installed_takes_no_lease(destroyed):
    """partition_activations without an mpu is refused at the lease, and the process is left as it was: no lease
    held, no checkpointing installed, so the next engine starts clean (a failed build leaks nothing)."""
    from zerodp import activations

    runtime = Runtime()
    bad = load_config({"activation_checkpointing": {"partition_activations": True}})
    with pytest.raises(ValueError, match="no model-parallel unit"):
        runtime.lease(bad, rank=0, checkpointing=True)
    assert runtime.leases == [] and activations.PROCESS.checkpointer is None
    runtime.lease(bad, rank=0).close()  # an engine built directly (not by initialize) does not install it


def test_a_lease_without_checkpointing_leaves_the_process_checkpointing_alone(destroyed):
    from zerodp import activations

    held = Runtime().lease(load_config({"activation_checkpointing": {"profile": True}}), rank=0)
    assert activations.PROCESS.checkpointer is None
    held.close()
