"""The attempt every rank of an elastic job agrees on (comm/elastic_attempt.py), with threads as ranks over one
in-memory store (no process group): the store keeps an earlier attempt's keys, as torch's agent store does, and
the ranks still agree on a new index and on the job; a run folder knows its job (run_folder.holds_this_job)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from zerodp.tools.app import run_folder
from zerodp.comm import elastic_attempt

TIMEOUT = timedelta(seconds=20)


def _start(store: dist.Store, world_size: int, ranks, got: dict, errors: list) -> list[threading.Thread]:
    """Start each rank in `ranks` agreeing, in a thread; results land in `got` (rank -> attempt)."""
    def one(rank: int) -> None:
        try:
            got[rank] = elastic_attempt.agree(store, rank, world_size, TIMEOUT)
        except Exception as err:  # reported by the test, with the rank
            errors.append((rank, err))

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    return threads


def _attempt(store: dist.Store, world_size: int) -> dict[int, elastic_attempt.ElasticAttempt]:
    """Every rank agrees (rank 0 last, after the others posted their nonces); returns rank -> its attempt."""
    got, errors = {}, []
    for t in _start(store, world_size, range(world_size - 1, -1, -1), got, errors):
        t.join(30)
    assert not errors and len(got) == world_size, errors
    return got


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-under-test")
    s = dist.HashStore()
    s.set_timeout(TIMEOUT)
    return s


def test_every_rank_agrees_and_each_attempt_gets_a_new_index_despite_stale_keys(store):
    first = _attempt(store, 4)
    assert {a.index for a in first.values()} == {0} and len({a.job_id for a in first.values()}) == 1
    second = _attempt(store, 4)  # the store still holds every key of the first attempt (stale hellos too)
    assert {a.index for a in second.values()} == {1}
    assert {a.job_id for a in second.values()} == {first[0].job_id}  # the same job in every attempt
    assert first[0].prefix(1) != second[0].prefix(1) and second[0].prefix(1) == second[3].prefix(1)


def test_rank_0_answering_a_dead_attempts_nonce_first_still_reaches_every_rank(store):
    # an earlier attempt's rank 3 posted its nonce and died; this attempt's rank 0 reads it before the new rank 3
    # posts its own: the answer goes to a key nobody waits on, and rank 0 keeps answering until all acknowledged
    store.set("zerodp/elastic/job-under-test/hello/3", "dead-attempts-nonce")
    got, errors = {}, []
    threads = _start(store, 4, [0, 1, 2], got, errors)
    store.wait(["zerodp/elastic/job-under-test/answer/dead-attempts-nonce"])  # rank 0 answered the dead nonce
    assert 0 not in got  # still waiting for the real rank 3
    threads += _start(store, 4, [3], got, errors)
    for t in threads:
        t.join(30)
    assert not errors and {r: a.index for r, a in got.items()} == {0: 0, 1: 0, 2: 0, 3: 0}


def test_a_rank_that_never_arrives_is_named_after_the_timeout(store, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    got, errors = {}, []
    _start(store, 3, [1], got, errors)  # rank 1 comes, rank 2 never does
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\] never joined the store at node0:29500"):
        elastic_attempt.agree(store, 0, 3, timedelta(seconds=0.5))


def test_run_folder_knows_its_job(tmp_path, monkeypatch):
    attempt = elastic_attempt.ElasticAttempt("abc123", 1, None)
    monkeypatch.setattr(elastic_attempt, "current", lambda timeout=None: attempt)
    assert run_folder.restart_count() == 1 and run_folder.this_job() == "abc123"
    assert not run_folder.holds_this_job(tmp_path)  # no run.json: not this job's
    (tmp_path / "run.json").write_text(json.dumps({"args": {}, "job": "other"}))
    assert not run_folder.holds_this_job(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"args": {}, "job": "abc123"}))
    assert run_folder.holds_this_job(tmp_path)
    (tmp_path / "run.json").write_text("{trunc")
    assert not run_folder.holds_this_job(tmp_path)


def test_outside_an_agent_store_the_local_count_is_used(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert elastic_attempt.current() is None
    assert run_folder.restart_count() == 2 and run_folder.this_job() is None
