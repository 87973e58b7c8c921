"""Two engines in one process, as a trainer with a second model has them: engine A (stage 2, ParityNet, AdamW)
and engine B (stage 3, another model, SGD with momentum) step side by side on 2 gloo ranks; A is closed while
B trains on. Each equals its own plain-PyTorch reference (losses and parameters), and the process-wide state
is given back in order (zerodp/engine/runtime.py): A's close() leaves the default group and the watchdog settings B
uses; B's close(), the last, destroys the default group zerodp created and restores the settings of before. While
the two step side by side, every collective each engine issues is watched with that engine's own comm_timeout_s.

The ranks are launched as torchrun launches them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that
`zerodp.initialize` creates the default group itself: the case where closing A used to destroy the group
under B, whose next forward then failed in comm.all_gather ("output has N elements, expected 1 x N/2").
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from tests.dist.common import (IN, OUT, assert_matches_reference, global_batch, make_model, make_optimizer,
                               micro_batch, reference_run)
from tests.oracle import train_reference
from zerodp.comm import watchdog

WORLD, MICRO_BS, STEPS_A, STEPS_B = 2, 2, 3, 5
TIMEOUT_A, TIMEOUT_B = 111.0, 222.0   # the engines' comm_timeout_s: the watchdog must follow the live engines


def model_b() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(IN, 31), nn.Tanh(), nn.Linear(31, 17), nn.Tanh(), nn.Linear(17, OUT))


def optimizer_b(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def reference_b() -> tuple[list[float], dict]:
    """Model B trained by plain PyTorch on the global batch, one process."""
    def step_loss(model: nn.Module, step: int) -> torch.Tensor:
        x, y = global_batch(step, MICRO_BS * WORLD)
        return F.mse_loss(model(x), y)

    model = model_b()
    ref = train_reference(model, optimizer_b(model), STEPS_B, step_loss)
    return ref.losses, ref.params


def _step(engine, step: int, timeouts: set) -> float:
    """One optimizer step on this rank's micro-batch; the global-mean loss. `timeouts` gets the comm_timeout_s
    of every collective the step issued (the flight recorder's entries)."""
    issued_before = watchdog.recent()[-1].seq if watchdog.recent() else 0
    rank = dist.get_rank()
    x, y = micro_batch(step, 0, rank, WORLD, MICRO_BS, 1)
    loss = F.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    timeouts.update(e.timeout_s for e in watchdog.recent() if e.seq > issued_before)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / WORLD


def _two_engines() -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": 1}
    before = watchdog.settings()
    model_a = make_model()
    a = zerodp.initialize(model_a, make_optimizer("adamw", model_a),
                          {**config, "comm_timeout_s": TIMEOUT_A, "zero_optimization": {"stage": 2}})
    assert dist.is_initialized() and zerodp.comm.owns_default_group(), "zerodp was to create the default group"
    b_model = model_b()
    b = zerodp.initialize(b_model, optimizer_b(b_model),
                          {**config, "comm_timeout_s": TIMEOUT_B,
                           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    assert watchdog.timeout_s() == TIMEOUT_B  # the newest engine's settings are in force
    losses_a, losses_b, timeouts_a, timeouts_b = [], [], set(), set()
    for step in range(STEPS_A):  # interleaved: A, B, A, B, ...
        losses_a.append(_step(a, step, timeouts_a))
        losses_b.append(_step(b, step, timeouts_b))
    assert watchdog.timeout_s() == TIMEOUT_B  # between calls: the newest engine's
    # each engine's collectives are watched with its own timeout, though B (the newest) was built last
    assert (timeouts_a, timeouts_b) == ({TIMEOUT_A}, {TIMEOUT_B}), (timeouts_a, timeouts_b)
    params_a = {k: v.detach().clone() for k, v in model_a.state_dict().items()}  # stage 2: whole on every rank
    a.close()
    assert dist.is_initialized(), "closing A destroyed the default group B trains on"
    assert watchdog.timeout_s() == TIMEOUT_B
    for step in range(STEPS_A, STEPS_B):
        losses_b.append(_step(b, step, timeouts_b))
    params_b = b.full_state_dict(rank0_only=False)
    b.close()
    closed = {"group_destroyed": not dist.is_initialized(), "watchdog_restored": watchdog.settings() == before}
    return {"losses_a": losses_a, "params_a": params_a, "losses_b": losses_b, "params_b": params_b, **closed}


def _rank_main(rank: int, port: int, results) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    try:
        out = _two_engines()
        results.put((rank, "ok", {k: v.tolist() if torch.is_tensor(v) else
                                  ({n: t.tolist() for n, t in v.items()} if isinstance(v, dict) else v)
                                  for k, v in out.items()}))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_two_engines_step_side_by_side_and_one_closes_while_the_other_trains():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results), daemon=True) for rank in range(WORLD)]
    for p in procs:
        p.start()
    try:
        ref_a = reference_run("adamw", STEPS_A, MICRO_BS * WORLD, 0.0)  # while the ranks start
        ref_b = reference_b()
        replies = dict((rank, (status, value)) for rank, status, value in (results.get(timeout=200) for _ in procs))
    finally:
        for p in procs:  # their work is done once they replied (or failed): no need to wait for their exit
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for rank, (status, value) in sorted(replies.items()):
        assert status == "ok", f"rank {rank} failed:\n{value}"
    for rank, (_, out) in sorted(replies.items()):
        params_a = {k: torch.tensor(v) for k, v in out["params_a"].items()}
        params_b = {k: torch.tensor(v) for k, v in out["params_b"].items()}
        assert_matches_reference(rank, out["losses_a"], params_a, *ref_a, what="engine A (stage 2)")
        assert_matches_reference(rank, out["losses_b"], params_b, *ref_b, what="engine B (stage 3)")
        assert out["group_destroyed"], "the last engine's close() left the default group zerodp created"
        assert out["watchdog_restored"], "the watchdog's settings from before the engines did not come back"
