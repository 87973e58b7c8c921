"""Memory of checkpoints with offload: save and load hold one unit at a time, not a rank's shard.

A 100.7M-parameter MLP (24 x Linear(2048, 2048), fp32 AdamW; model states 16 bytes x Ψ = 1.6 GB,
each rank's part of the checkpoint 576 MiB) is built under zerodp.init_context and trained at
stage 3 on 2 gloo ranks with offload_param and offload_optimizer on nvme, configured as a user
writes it: only `device` and `nvme_path`. Memory is the OS's figure, with no malloc_trim anywhere:
`ru_maxrss`, the process's peak RSS so far, in fresh processes (a new worker pool per phase):
  train:  build, initialize, STEPS steps (-> the training peak), save_checkpoint (-> the peak with
          the save), MORE steps (the uninterrupted run's losses)
  resume: build, initialize, load_checkpoint (-> the peak with the load), MORE steps
Asserted per rank: the peak with the save and the peak of the fresh process with the load are at
most BOUND x the training peak (issue 21: "at most 10% above the training peak"), and the resumed
losses equal the uninterrupted ones exactly (the same arithmetic on the same values). Before
checkpoints streamed unit by unit the save reached 1.13x and the load 1.45x
(bench/results/checkpoint_rss.md).

The loss trajectory itself is compared against plain PyTorch in test_offload_param.py and
test_checkpoint.py; this test is about what the OS sees at 100M parameters (about 45 s on the
shared 2-core machine: two fresh pools, 1 GB of offload files written and read per rank).
"""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from tests.dist import harness

WIDTH, DEPTH, MICRO_BS, STEPS, MORE = 2048, 24, 4, 2, 2
BOUND = 1.10  # issue 21's acceptance: save/load peak at most 10% above the training peak


def peak_rss() -> int:
    """This process's peak RSS so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def user_config(nvme_dir: str) -> dict:
    offload = {"device": "nvme", "nvme_path": nvme_dir}
    return {"train_micro_batch_size_per_gpu": MICRO_BS,
            "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": dict(offload)}}


def build(nvme_dir: str):
    cfg = user_config(nvme_dir)
    with zerodp.init_context(cfg):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    numel = sum(p.numel() for p in model.parameters())
    return zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg), numel


def train(engine, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(MICRO_BS, WIDTH, generator=torch.Generator().manual_seed(1000 * step + dist.get_rank()))
        loss = F.mse_loss(engine(x), x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_and_save(nvme_dir: str, ckpt_dir: str) -> dict:
    engine, numel = build(nvme_dir)
    train(engine, 0, STEPS)
    trained = peak_rss()
    engine.save_checkpoint(ckpt_dir, tag="mid")
    saved = peak_rss()
    losses = train(engine, STEPS, MORE)
    engine.close()
    return {"numel": numel, "trained": trained, "saved": saved, "losses": losses}


def load_and_resume(nvme_dir: str, ckpt_dir: str) -> dict:
    engine, _ = build(nvme_dir)
    initialized = peak_rss()
    engine.load_checkpoint(ckpt_dir, tag="mid")
    loaded = peak_rss()
    losses = train(engine, STEPS, MORE)
    engine.close()
    return {"initialized": initialized, "loaded": loaded, "losses": losses}


def in_fresh_ranks(fn, *args) -> list:
    """`fn` on 2 newly spawned ranks: ru_maxrss is a process's high-water mark, so every phase needs
    processes that ran nothing before (the shared pools have run other cases)."""
    pool = harness.WorkerPool(2)
    try:
        return pool.run(fn, *args, timeout=300)
    finally:
        pool.close()


def test_offloaded_save_and_load_stay_within_the_training_peak(tmp_path):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    first = in_fresh_ranks(train_and_save, str(nvme), str(ckpt))
    second = in_fresh_ranks(load_and_resume, str(nvme), str(ckpt))
    assert first[0]["numel"] >= 100_000_000
    for rank, (a, b) in enumerate(zip(first, second)):
        gib = lambda v: f"{v / 2**30:.2f} GiB"
        print(f"rank {rank}: peak RSS training {gib(a['trained'])}, with the save {gib(a['saved'])}; fresh process: "
              f"initialized {gib(b['initialized'])}, with the load {gib(b['loaded'])}")
        assert a["saved"] <= BOUND * a["trained"], f"rank {rank}: the save raised peak RSS to {gib(a['saved'])}"
        assert b["loaded"] <= BOUND * a["trained"], f"rank {rank}: the load raised peak RSS to {gib(b['loaded'])}"
        assert b["losses"] == a["losses"], f"rank {rank}: resumed {b['losses']} vs uninterrupted {a['losses']}"
    assert list(nvme.iterdir()) == []  # both engines closed: their offload files are gone
