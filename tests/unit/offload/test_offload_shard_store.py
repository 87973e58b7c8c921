"""ShardStore (offload/shard_store.py) without a process group: bytes round-trip bitwise through
the files, at most max_in_cpu elements stay resident, dirty shards are written before they are freed,
views made while resident see the values read back later, read-ahead follows the last step's order,
and the rank folder goes on close."""

from __future__ import annotations

import pytest
import torch

from zerodp.offload.file_io import FileIO
from zerodp.offload.shard_store import ShardStore, ShardHome
from zerodp.offload.run_dir import RankDir


def make_store(tmp_path, max_in_cpu: int, buffer_count: int = 2) -> ShardStore:
    return ShardStore(RankDir(str(tmp_path), "unit", 0), FileIO(2, 4096), max_in_cpu, buffer_count)


def shards(n: int, numel: int = 1000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def state(store: ShardStore, shard: torch.Tensor) -> ShardHome:
    return store.entries[id(shard)].state


def test_values_round_trip_bitwise_and_memory_stays_bounded(tmp_path):
    store = make_store(tmp_path, max_in_cpu=2000)
    tensors = shards(5)
    expected = [t.clone() for t in tensors]
    views = [t[10:20] for t in tensors]  # views made while resident: they must see re-read values
    for t in tensors:
        store.adopt(t)
        assert store.resident_numel <= 2000
    assert store.disk_bytes() == 5 * 1000 * 4
    for t, want, view in zip(tensors, expected, views):
        with store.resident([t]):
            assert torch.equal(t, want) and torch.equal(view, want[10:20])
        assert store.resident_numel <= 2000
    assert sum(state(store, t) is ShardHome.OFFLOADED for t in tensors) >= 3
    store.close()
    assert not (tmp_path / "zerodp-unit").exists()


def test_dirty_shards_are_written_before_they_are_freed(tmp_path):
    store = make_store(tmp_path, max_in_cpu=1000)
    a, b = shards(2)
    store.adopt(a)
    store.adopt(b)
    with store.resident([a], dirty=True):
        a.mul_(3.0)
    want = a.clone()
    with store.resident([b]):  # evicts a (a write, then its storage is freed)
        assert state(store, a) in (ShardHome.WRITING, ShardHome.OFFLOADED)
    with store.resident([a]):
        assert torch.equal(a, want)
    store.close()


def test_needed_shards_exceed_the_cache_but_read_ahead_does_not(tmp_path):
    store = make_store(tmp_path, max_in_cpu=2000, buffer_count=4)
    tensors = shards(4)
    for t in tensors:
        store.adopt(t)
    with store.resident(tensors[:3]):  # all needed at once: 3000 > 2000 elements, allowed
        held = store.resident_numel
    assert held == 3000 and store.resident_numel <= 2000
    # a step's order: 0, 1, 2, 3; next step, acquiring 0 reads 1 ahead (room for one more only)
    for t in tensors:
        with store.resident([t]):
            pass
    store.end_step()
    store.acquire(tensors[0])
    ahead = [state(store, t) for t in tensors]
    resident = store.resident_numel
    assert ahead[1] in (ShardHome.READING, ShardHome.RESIDENT) and resident <= 2000
    store.release(tensors[0])
    store.close()


def test_discard_frees_the_shard_and_its_file(tmp_path):
    store = make_store(tmp_path, max_in_cpu=10_000)
    (a,) = shards(1)
    store.adopt(a)
    path = store.rank_dir.path_of("param0.values.bin")
    store.flush()
    assert path.exists()
    store.discard(a)
    assert not path.exists() and a.untyped_storage().size() == 0 and store.resident_numel == 0
    store.close()


def test_deepspeed_zero_init_remote_device_must_match_the_config(tmp_path):
    import pytest

    from zerodp.config import ConfigError
    from zerodp.deepspeed.zero import Init

    stage3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match="offload_param.device is 'none'"):
        Init(config_dict_or_path=stage3, remote_device="nvme")
    offloaded = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    assert Init(config_dict_or_path=offloaded, remote_device="nvme").config.zero_optimization.offload_param.enabled


def test_estimate_with_parameter_offload_moves_the_shard_to_disk_and_the_cache_to_host():
    from zerodp.tools.plan.offload_estimate import predict_param_offload_bytes, render_offload_estimate

    # fp32 Adam, 3e9 parameters on 2 ranks: the 4-byte shard (also the master) goes to disk; the host
    # keeps max_in_cpu elements of it plus buffer_count optimizer windows; in fp32 the gradient shard
    # goes the same way as the parameter shard, so nothing stays on the device
    table = render_offload_estimate(3e9, 2, (4, 4, 8), 2, "nvme", (1, 3), 1e7, 4, "nvme", 2e8)
    assert "| 1 | offload_param needs stage 3 | | |" in table
    # host 4 x 2e8 (parameters) + 4 x 1e7 x 8 (windows) + 4 x 2e8 (gradients); disk (12 + 4) x 1.5e9
    assert "| 3 | 0 | 1.92 | 24 |" in table
    # bf16 (2-byte parameters and gradients, 4-byte master): the gradient shard stays on the device
    table = render_offload_estimate(3e9, 2, (2, 2, 12), 2, "nvme", (3,), 1e7, 4, "nvme", 2e8)
    assert "| 3 | 9 | 0.72 | 15 |" in table  # device 2 x 1.5e9 + 4 x 1.5e9; host 2 x 2e8 + 0.32e9; disk
    assert predict_param_offload_bytes(1e6, 2, "nvme", 1e9).host == 2e6  # the cache never exceeds the shard
    assert predict_param_offload_bytes(1e6, 4, "cpu").disk == 0


def test_zero_shards_are_never_read_and_their_zeros_reach_the_file(tmp_path):
    """A gradient store's shards start as zeros and are zeroed after every step (GradShard.zero_grad):
    that costs no I/O, acquiring a zero shard gives zeros, and once changed they are written back."""
    store = ShardStore(RankDir(str(tmp_path), "unit", 0), FileIO(2, 4096), 1000, 2, kind="grad")
    a, b = shards(2)
    store.adopt(a, zeros=True)
    store.adopt(b, zeros=True)
    assert store.resident_numel == 0 and store.io.written_bytes == 0
    assert (tmp_path / "zerodp-unit" / "rank0" / "grad0.values.bin").exists()  # files named by the kind
    with store.resident([a], dirty=True):
        assert torch.equal(a, torch.zeros(1000))
        a.add_(2.0)
    assert store.io.read_bytes == 0
    with store.resident([b]):  # evicts a: written, although b was only read (its zeros are dirty too)
        assert torch.equal(b, torch.zeros(1000))
    with store.resident([a]):
        assert torch.equal(a, torch.full((1000,), 2.0))  # read back from the file
    reads = store.io.read_bytes
    store.zero(a)
    store.zero(b)
    assert store.resident_numel == 0
    with store.resident([a]):
        assert torch.equal(a, torch.zeros(1000))  # not the file's 2.0: zero() made the file stale
    assert store.io.read_bytes == reads
    store.close()


def test_a_store_without_read_ahead_records_no_order(tmp_path):
    """The gradient store (read_ahead=False) is never planned by end_step(): acquiring must not grow a
    trace for the whole run (it grew by every acquire, step after step), and nothing is read ahead."""
    store = ShardStore(RankDir(str(tmp_path), "unit", 0), FileIO(2, 4096), 1000, 2, read_ahead=False)
    tensors = shards(3)
    for t in tensors:
        store.adopt(t)
    for _ in range(5):
        for t in tensors:
            with store.resident([t]):
                pass
    assert store.trace == [] and store.read_ahead is False
    store.end_step()
    store.acquire(tensors[0])
    assert [state(store, t) for t in tensors[1:]] == [ShardHome.OFFLOADED] * 2  # nothing read ahead
    store.release(tensors[0])
    store.close()


def test_zero_gradient_files_hold_no_disk_until_the_next_backward_reserves_it(tmp_path, monkeypatch):
    """Gradient files are created sparse and punched out when zeroed; `reserve` (the start of a backward) takes
    the blocks again, and on a full disk says how much is needed and why, before anything is written."""
    import errno
    import os

    store = ShardStore(RankDir(str(tmp_path), "unit", 0), FileIO(2, 4096), 0, 2, kind="grad")
    (a,) = shards(1, numel=1 << 18)  # 1 MiB: whole file-system blocks
    store.adopt(a, zeros=True)
    fd = next(iter(store.entries[id(a)].backing.fds.values()))
    assert os.fstat(fd).st_size == 1 << 20 and os.fstat(fd).st_blocks == 0
    store.reserve()
    assert os.fstat(fd).st_blocks * 512 >= 1 << 20
    with store.resident([a], dirty=True):
        a.fill_(3.0)
    with store.resident([a]):
        assert torch.equal(a, torch.full_like(a, 3.0))
    store.zero(a)
    assert os.fstat(fd).st_blocks == 0 and os.fstat(fd).st_size == 1 << 20

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"grad shards' files need [0-9.]+ GiB more under .*a checkpoint\?"):
        store.reserve()
    monkeypatch.undo()
    store.reserve()
    with store.resident([a]):
        assert torch.equal(a, torch.zeros_like(a))
    store.close()
