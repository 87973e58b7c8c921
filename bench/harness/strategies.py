"""The strategies the benchmark compares, each wrapped behind one interface: `setup(model) -> Runner`.

A Runner exposes `forward(x)`, `backward(loss)`, `step()` and `model_state_bytes()` (this rank's
parameters, gradients and optimizer state, counting local shards only). Peers are used as their
documentation says (DDP defaults, FSDP units per transformer block plus the root, DeepSpeed's JSON
with torch's AdamW); nothing here tunes one strategy and not the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

LR, WD = 1e-3, 0.01


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        key = (t.untyped_storage().data_ptr(), t.data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _optimizer_bytes(opt) -> int:
    return _nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


@dataclass
class Runner:
    forward: Callable
    backward: Callable
    step: Callable
    model_state_bytes: Callable[[], dict]
    # the ZeRO formula's prediction for this rank (zerodp only: it knows its own layout)
    predicted_state_bytes: Callable[[], Optional[dict]] = field(default=lambda: None)


def _plain(model: nn.Module, opt) -> Runner:
    def step():
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated, like DDP's buckets, for the count

    def states():
        return {"params": _nbytes(model.parameters()), "grads": _nbytes(p.grad for p in model.parameters()),
                "optimizer": _optimizer_bytes(opt)}
    return Runner(model, lambda loss: loss.backward(), step, states)


def ddp(model: nn.Module) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model)
    runner = _plain(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    runner.forward = wrapped
    return runner


def torch_zero1(model: nn.Module) -> Runner:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WD)
    runner = _plain(model, opt)
    runner.forward = wrapped
    runner.model_state_bytes = lambda: {"params": _nbytes(model.parameters()),
                                        "grads": _nbytes(p.grad for p in model.parameters()),
                                        "optimizer": _optimizer_bytes(opt.optim)}
    return runner


def fsdp1(model: nn.Module, strategy: str) -> Runner:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from zerodp.tools.models.gpt import Block

    wrapped = FSDP(model, sharding_strategy=getattr(ShardingStrategy, strategy),
                   auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, weight_decay=WD)
    runner = _plain(wrapped, opt)
    runner.forward = wrapped
    return runner


def fsdp2(model: nn.Module) -> Runner:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return _plain(model, opt)


def zerodp_stage(model: nn.Module, stage: int, **zero_keys) -> Runner:
    from zerodp.engine.zero_engine import initialize

    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
                               {"zero_optimization": {"stage": stage, **zero_keys}})

    def states(which: str = "measured"):
        rep = getattr(engine.memory_report(), which)
        return {"params": rep.params, "grads": rep.grads, "optimizer": rep.optimizer}
    return Runner(engine, engine.backward, engine.step, states, lambda: states("predicted"))


def deepspeed_stage(model: nn.Module, stage: int) -> Runner:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def states():
        inner = opt.optimizer if hasattr(opt, "optimizer") else opt
        masters = getattr(opt, "single_partition_of_fp32_groups", None) or \
            getattr(opt, "fp32_partitioned_groups_flat", None) or []
        params = [getattr(p, "ds_tensor", p) for p in model.parameters()]
        return {"params": _nbytes(params), "grads": 0, "optimizer": _optimizer_bytes(inner) + _nbytes(masters)}
    return Runner(engine, engine.backward, engine.step, states)


STRATEGIES: dict[str, Callable[[nn.Module], Runner]] = {
    "ddp": ddp,
    "torch_zero1": torch_zero1,
    "fsdp1_grad_op": lambda m: fsdp1(m, "SHARD_GRAD_OP"),
    "fsdp1_full": lambda m: fsdp1(m, "FULL_SHARD"),
    "fsdp2": fsdp2,
    **{f"zerodp{s}": (lambda m, s=s: zerodp_stage(m, s)) for s in range(4)},
    **{f"deepspeed{s}": (lambda m, s=s: deepspeed_stage(m, s)) for s in range(4)},
    # ZeRO++'s quantized collectives (an approximation: its losses are not DDP's)
    "zerodp3_qwz_qgz": lambda m: zerodp_stage(m, 3, zero_quantized_weights=True, zero_quantized_gradients=True),
}

# Which peers answer which ZeRO stage (for the ratio columns).
PEERS_OF_STAGE = {0: ["ddp", "deepspeed0"], 1: ["torch_zero1", "deepspeed1"],
                  2: ["fsdp1_grad_op", "deepspeed2"], 3: ["fsdp1_full", "fsdp2", "deepspeed3"]}

