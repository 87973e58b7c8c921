"""What the engine checks about the model and the optimizer before it shards anything.

Ranks must hold the same model (names, shapes, dtypes, which are trainable), or their collectives
would later hang or mix tensors; the optimizer must hold exactly the model's trainable parameters.
Both are refused with a message naming the first difference, before any state exists.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..errors import ConfigError


def check_same_model(model: nn.Module, process_group: comm.ProcessGroup) -> None:
    """Refuse to start when ranks built different models (they would hang or mix tensors later)."""
    if comm.get_world_size(process_group) == 1:
        return
    mine = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
            for name, p in model.named_parameters()]
    every = comm.all_gather_object(mine, process_group)  # once, at start-up
    for rank, theirs in enumerate(every):
        if theirs == every[0]:
            continue
        for i, (a, b) in enumerate(zip(every[0], theirs)):
            if a != b:
                raise ConfigError(f"ranks built different models: parameter {i} is {a} on rank 0 but {b} on rank "
                                  f"{rank} (name, shape, dtype, requires_grad); every rank must build the same model")
        n0, n = len(every[0]), len(theirs)
        extra = (every[0] if n0 > n else theirs)[min(n0, n)]
        raise ConfigError(f"ranks built different models: rank 0 has {n0} parameters, rank {rank} has {n} "
                          f"(first extra: {extra}); every rank must build the same model")


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_groups(model: nn.Module, optimizer) -> list[list[nn.Parameter]]:
    """The optimizer's groups restricted to trainable parameters, checked against the model."""
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = {id(p) for p in trainable_parameters(model)}
    groups, seen = [], set()
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                                  f"of the model; build the optimizer on model.parameters()")
            if id(p) in trainable:  # frozen parameters never reach the optimizer, as they get no grad
                kept.append(p)
                seen.add(id(p))
        groups.append(kept)
    missing = [names[id(p)] for p in trainable_parameters(model) if id(p) not in seen]
    if missing:
        raise ConfigError(f"trainable parameters not in the optimizer: {', '.join(missing[:5])}"
                          f"{' ...' if len(missing) > 5 else ''}; add them or set requires_grad=False")
    # Parameter order inside a group follows the model (not the optimizer), so every rank agrees.
    order = {id(p): i for i, p in enumerate(model.parameters())}
    return [sorted(g, key=lambda p: order[id(p)]) for g in groups]


def broadcast_module_state(module: nn.Module, process_group: comm.ProcessGroup) -> None:
    """Every rank starts from rank 0's weights and buffers, as DDP does (note: one broadcast per tensor)."""
    from ..shard.stage3.params import PartitionedParameter

    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if isinstance(t, PartitionedParameter):
                continue  # created partitioned by zerodp.init_context: equal on every rank already
            comm.broadcast(t.data, 0, process_group, tag="init")
