"""The engine: one model trained at any ZeRO stage, and everything that builds it.

    zero_engine.py  ZeroEngine and `initialize`: forward, backward, step, accumulation, checkpoints, close
    sharding.py     build_sharding: the user's model and optimizer -> the stage's strategy and the sharded optimizer
    preflight.py    what is checked about the model and the optimizer before anything is sharded
    runtime.py      Runtime: the process-wide state zerodp changes, and each engine's Lease on it
    nonfinite.py    non-finite gradients in bf16/fp32, detected on every rank at once, then stop or skip
    optimizer_offload.py  the optimizer-state offload (ZeRO-Offload/Infinity) from the config, over offload/'s stores
    grad_path.py    compose_grad_staging: where reduced gradient shards go (memory, store, host staging), once
    step_log.py     log_step: the rank-0 progress line every steps_per_print steps (wall_clock_breakdown's seconds)

The engine drives the layers below it in one direction: shard/ (the sharded state), optim/ (the sharded step),
offload/ (where each state lives), comm/ (the collectives).
"""

from .zero_engine import ZeroEngine, initialize

__all__ = ["ZeroEngine", "initialize"]
