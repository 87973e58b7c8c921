"""Every test starts without ZERODP_DEEPSPEED_ALIAS (set to "0", off) and leaves none behind:
`zerodp.deepspeed.run` sets it for the processes a script starts, and a test that calls its `main` in this
process must not hand the alias to the subprocesses of the tests after it."""

import pytest


@pytest.fixture(autouse=True)
def _no_deepspeed_alias_in_children(monkeypatch):
    monkeypatch.setenv("ZERODP_DEEPSPEED_ALIAS", "0")  # restored (removed) after the test
