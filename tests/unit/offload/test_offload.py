"""The offload tier without a process group: config errors, the NVMe folder's life cycle, bitwise file
round trips, the window plan, and the streaming state store against an in-memory optimizer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zerodp.config import ConfigError, load_config
from zerodp.offload.file_io import FileIO
from zerodp.offload.optimizer_state import OffloadedOptimizerState, plan_windows
from zerodp.offload.run_dir import OffloadPathError, RankDir, check_nvme_path, find_leftovers
from zerodp.offload.store import FileStore, HostStore

# A ZeRO-Infinity config as DeepSpeed documents it (docs/_pages/config-json.md, "Optimizer offloading",
# "Parameter offloading" and "Asynchronous I/O" sections), with zerodp's nvme_path.
DEEPSPEED_INFINITY = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {
        "stage": 3, "sub_group_size": 1e9,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9},
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
}


def test_deepspeed_infinity_config_loads():
    cfg = load_config(DEEPSPEED_INFINITY)
    zero = cfg.zero_optimization
    assert zero.offload_optimizer.device.value == "nvme" and zero.offload_optimizer.buffer_count == 4
    assert zero.offload_param.buffer_size == 100_000_000 and zero.sub_group_size == 1_000_000_000
    assert cfg.aio.block_size == 1 << 20 and cfg.aio.io_requests == 8  # 1 thread x queue depth 8


@pytest.mark.parametrize("zero, aio, fragment", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, {}, "offload_optimizer needs stage 1"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, {}, "offload_optimizer.nvme_path is not set"),
    ({"stage": 2, "offload_optimizer": {"device": "disk"}}, {}, "'none', 'cpu' or 'nvme'"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 0}}, {}, "buffer_count"),
    ({"stage": 3, "offload_param": {"device": "cpu", "buffer_size": 0}}, {}, "buffer_size"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, {}, "ratio"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_cnt": 2}}, {}, "did you mean 'buffer_count'"),
    ({"stage": 2, "sub_group_size": -1}, {}, "sub_group_size"),
    ({"stage": 2}, {"block_size": 1000}, "multiple of 512"),
    ({"stage": 2}, {"queue_depth": 0}, "queue_depth"),
])
def test_bad_offload_config_names_the_key(zero, aio, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        load_config({"zero_optimization": zero, "aio": aio})
    assert fragment in str(err.value)


def test_nvme_path_checks(tmp_path):
    key = "zero_optimization.offload_optimizer.nvme_path"
    with pytest.raises(OffloadPathError, match="does not exist; create the directory"):
        check_nvme_path(str(tmp_path / "missing"), key, 0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OffloadPathError, match="is not a directory"):
        check_nvme_path(str(tmp_path / "file"), key, 0)
    with pytest.raises(OffloadPathError, match="GiB free but this run needs"):
        check_nvme_path(str(tmp_path), key, 1 << 62)
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OffloadPathError, match="is not writable"):
            check_nvme_path(str(locked), key, 0)
    check_nvme_path(str(tmp_path), key, 1024)


@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_rank_dir_life_cycle_and_leftovers(tmp_path):
    d = RankDir(str(tmp_path), "abc", 1)
    assert d.path == tmp_path / "zerodp-abc" / "rank1" and d.path.is_dir()
    assert find_leftovers(str(tmp_path)) == []  # owned by this live process
    with pytest.raises(OffloadPathError, match="never reuses"):
        RankDir(str(tmp_path), "abc", 1)
    d.close()
    assert not (tmp_path / "zerodp-abc").exists()
    # a process that exits normally without closing removes its folder; a killed one leaves it behind
    script = textwrap.dedent(f"""
        import os, sys
        from zerodp.offload.run_dir import RankDir
        d = RankDir({str(tmp_path)!r}, sys.argv[1], 0)
        d.path_of("x.bin").write_bytes(b"1" * 4096)
        if sys.argv[1] == "crash":
            os._exit(1)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for run_id in ("normal", "crash"):
        subprocess.run([sys.executable, "-c", script, run_id], env=env, check=False)
    assert not (tmp_path / "zerodp-normal").exists()
    leftovers = find_leftovers(str(tmp_path))
    assert [p for p, _ in leftovers] == [tmp_path / "zerodp-crash" / "rank0"] and leftovers[0][1] >= 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_file_store_round_trips_bytes_bitwise(tmp_path, dtype):
    rank_dir = RankDir(str(tmp_path), "rt", 0)
    io = FileIO(threads=3, block_bytes=512)  # many small pieces in parallel
    store = FileStore(rank_dir, 5000, io)
    store.ensure("state", dtype)
    values = torch.randn(5000, generator=torch.Generator().manual_seed(0)).to(dtype)
    bits = values.view(torch.uint8)
    bits[:8] = torch.tensor([0, 0, 0xC0, 0x7F, 1, 0, 0xC0, 0x7F], dtype=torch.uint8)  # NaN payloads, subnormal
    handles = [store.write("state", 0, values[:1234]), store.write("state", 1234, values[1234:].clone())]
    for h in handles:
        h.wait()
    out = torch.empty(5000, dtype=dtype)
    store.read("state", 0, out).wait()
    assert torch.equal(out.view(torch.uint8), values.view(torch.uint8))
    assert out.dtype == dtype and store.disk_bytes() == 5000 * dtype.itemsize
    assert io.written_bytes == io.read_bytes == 5000 * dtype.itemsize
    store.close()
    io.close()
    rank_dir.close()


def test_plan_windows():
    assert plan_windows([4, 4, 4, 3], 8) == [(0, 2, 0, 8), (2, 4, 8, 7)]
    assert plan_windows([10, 2], 8) == [(0, 1, 0, 10), (1, 2, 10, 2)]  # a chunk larger than a window: alone
    assert plan_windows([], 8) == []


@pytest.mark.parametrize("device, buffer_count, host_fraction", [("nvme", 1, 0.0), ("nvme", 2, 0.0),
                                                                   ("nvme", 3, 0.5), ("cpu", 4, 1.0)])
def test_streamed_adam_equals_resident_adam(tmp_path, device, buffer_count, host_fraction):
    """The store behind a plain torch Adam over chunk tensors: bitwise the same as Adam in memory."""
    def chunks():
        flat = torch.randn(103, generator=torch.Generator().manual_seed(1))
        return list(flat.split(10))

    plain, offloaded = chunks(), chunks()
    opt_plain = torch.optim.Adam(plain, lr=0.1)
    opt_off = torch.optim.Adam(offloaded, lr=0.1)
    rank_dir = RankDir(str(tmp_path), "adam", 0)
    io = FileIO(2)

    def make_stores(host_numel, file_numel):
        if device == "cpu":
            return HostStore(host_numel), None
        return (HostStore(host_numel) if host_numel else None), FileStore(rank_dir, file_numel, io)

    state = OffloadedOptimizerState(25, buffer_count, make_stores, host_fraction, owned=(io, rank_dir))
    state.attach(opt_off, [offloaded])
    assert len(state.windows) == 5  # 10 chunks of 10 and one of 3, two chunks per window
    for step in range(3):
        grads = torch.randn(103, generator=torch.Generator().manual_seed(10 + step)).split(10)
        for p, q, g in zip(plain, offloaded, grads):
            p.grad, q.grad = g, g.clone()
        opt_plain.step()

        def step_window(window):
            hidden = [(c, c.grad) for c in offloaded if all(c is not w for w in window)]
            for c, _ in hidden:
                c.grad = None
            opt_off.step()
            for c, g in hidden:
                c.grad = g

        state.step(step_window)
        # between steps only the scalar `step` stays in the optimizer
        assert all(set(opt_off.state[c]) == {"step"} for c in offloaded)
    assert all(torch.equal(p, q) for p, q in zip(plain, offloaded))
    with state.resident(list(range(len(offloaded)))):
        for p, q in zip(plain, offloaded):
            assert torch.equal(opt_plain.state[p]["exp_avg_sq"], opt_off.state[q]["exp_avg_sq"])
    assert state.host_bytes() <= max(buffer_count, 1) * 2 * 25 * 4 + host_fraction * 103 * 2 * 4 + 1
    state.close()
    assert not rank_dir.path.exists()
