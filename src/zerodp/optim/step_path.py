"""Which gradients one optimizer step reads, chosen once from (placement, optimizer class): `StepPath`.

The sharded optimizer (optimizer.py) builds one of these when it is built and its `step` runs it without
asking again which it is:

    BoundGradients      every placement: each unit's gradient, in the master dtype (a cast copy where the
                        shard's dtype differs, or, for a host step, the host copy of the shard as reduced), is
                        clipped and bound to its chunks whole, then the step plan walks its windows
                        (step_plan.py: offloaded optimizer state, offload_param's residency)
    TransientGradients  [Note: fp32 gradients at the step] (transient_grads.py): 16-bit shards with fp32 masters,
                        an elementwise optimizer of zerodp's list, nothing offloaded: the fp32 copies are made,
                        clipped and stepped one window of units at a time; nothing is bound before the step

Both take the norm from the same bits (the shards' own square norms where no loss scale divides them), so the
two paths give bitwise the same update; the choice is one of memory, decided by facts fixed at construction
(`transient_grads.transient_grads_apply`).
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Optional, Protocol

import torch

from .step_plan import StepPlan


class StepPath(Protocol):
    """The part of a step that depends on where its gradients come from (module docstring)."""

    def raw_grads(self, scale: float) -> bool: ...  # the norm is taken from the shards as reduced, no cast copy

    # clip by `coef` and bind what is bound before the finiteness check (`grads`: per unit, divided by `scale`)
    def bind(self, grads: list[torch.Tensor], coef: Optional[torch.Tensor], received: Optional[torch.Tensor],
             scale: float) -> None: ...

    # step every chunk once (`late`: parameters stepped after with their own counts, step_counts.py)
    def run(self, coef: Optional[torch.Tensor], received: Optional[torch.Tensor], late: AbstractSet[int]) -> None: ...


class BoundGradients:
    """Gradients bound whole before the step, then stepped in the plan's windows (module docstring)."""

    def __init__(self, plan: StepPlan, step_chunks: Callable[..., None], host_raw: bool) -> None:
        self.plan = plan
        self.step_chunks = step_chunks  # (received, window, late): the inner optimizer over one window's chunks
        # a host step reads host copies of the shards as reduced: without a loss scale (and without tensor
        # parallelism's norm rule, which reads cast copies) its norm is the shards' own, no fp32 copy on the device
        self.host_raw = host_raw

    def raw_grads(self, scale: float) -> bool:
        return self.host_raw and scale == 1.0

    def bind(self, grads: list[torch.Tensor], coef: Optional[torch.Tensor], received: Optional[torch.Tensor],
             scale: float) -> None:
        self.plan.bind_all(grads, coef, received, scale)  # clipped where they are; host copies for a host step

    def run(self, coef: Optional[torch.Tensor], received: Optional[torch.Tensor], late: AbstractSet[int]) -> None:
        self.plan.run(lambda window: self.step_chunks(received, window, late), received)


class TransientGradients:
    """fp32 gradient copies made, clipped and stepped one window at a time (module docstring)."""

    def __init__(self, step_transient: Callable[..., None]) -> None:
        self.step_transient = step_transient  # (coef, received, late): transient_grads.WindowedGradSteps.run

    def raw_grads(self, scale: float) -> bool:
        return True  # the norm comes from the 16-bit shards; their copies exist only per window

    def bind(self, grads: list[torch.Tensor], coef: Optional[torch.Tensor], received: Optional[torch.Tensor],
             scale: float) -> None:
        """Nothing: each window binds its own copies in `run`."""

    def run(self, coef: Optional[torch.Tensor], received: Optional[torch.Tensor], late: AbstractSet[int]) -> None:
        self.step_transient(coef, received, late)
