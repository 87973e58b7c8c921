"""Activation checkpointing with ZeRO-R: a region's forward runs without saving its activations,
its inputs are kept as the `activation_checkpointing` section says (kept_inputs.py), and backward
recomputes the region from them, with the random states of the forward (rng_tracker.py).

Two forms, DeepSpeed's and torch's:
  - re-entrant (`checkpoint`): the forward runs under no_grad inside an autograd Function, whose
    backward restores the inputs, recomputes with grad and backpropagates through the recomputed
    graph (a backward inside the backward);
  - non-re-entrant (`non_reentrant_checkpoint`): the forward runs with grad but every tensor the
    graph would save is replaced by a placeholder (saved-tensor hooks); the first placeholder
    backward unpacks triggers the recomputation, which fills all of them in order. Works when no
    input requires grad, and with `torch.autograd.grad`.
Both keep only the kept inputs between forward and backward, and recompute under the forward's
random states and autocast state. Keyword tensor arguments are inputs
like positional ones. A region called while grad is off saves nothing and keeps nothing.

ZeRO stage 3 gathers a region's parameters through module hooks, which fire in the recomputation
as in torch's checkpoint (stage3/module_unit.py handles both forms).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Optional

import torch

from ..config.activation_checkpointing import ActivationCheckpointingConfig
from .contiguous import ContiguousBuffers
from .host_offload import HostOffload
from .kept_inputs import KeepPolicy, KeptBytes, KeptInputs
from .model_parallel import ModelParallelGroup
from .rng_tracker import RNGSnapshot, RNGStatesTracker
from .region import autocast_as, bind_keywords, capture_autocast, split_outputs

log = logging.getLogger("zerodp.activations")


class Checkpointer:
    """One configuration of activation checkpointing: settings, model-parallel group, RNG tracker, buffers."""

    def __init__(self, settings: ActivationCheckpointingConfig, group: Optional[ModelParallelGroup] = None,
                 tracker: Optional[RNGStatesTracker] = None):
        if settings.partition_activations and group is None:
            raise ValueError("activation_checkpointing.partition_activations splits each checkpoint across the "
                             "model-parallel group, but no model-parallel unit (mpu) was given: pass one "
                             "(deepspeed.checkpointing.configure(mpu, ...)), or set partition_activations to "
                             "false (DeepSpeed would silently keep the inputs whole)")
        self.settings = settings
        self.group = group or ModelParallelGroup.single()
        self.tracker = tracker or RNGStatesTracker()
        self.policy = KeepPolicy(settings.partition_activations, settings.cpu_checkpointing,
                                 settings.contiguous_memory_optimization, self.group)
        self.buffers = ContiguousBuffers(settings.number_checkpoints) if self.policy.contiguous else None
        self.offload = HostOffload()
        self.kept_bytes = KeptBytes()
        self.timings: list[tuple[str, float]] = []  # ("forward" | "backward", seconds) with profile on

    def reset(self) -> None:
        """Drop the contiguous buffers (after forwards that had no backward, e.g. evaluation with grad on)."""
        if self.buffers is not None:
            self.buffers.reset()

    # -- the re-entrant form -------------------------------------------------------------------------

    def checkpoint(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)`, its activations recomputed in backward (re-entrant form)."""
        run, flat_args = bind_keywords(function, args, kwargs)
        if not torch.is_grad_enabled():
            return run(*flat_args)  # no backward will come: nothing to keep
        shape: dict[str, Any] = {}
        tensors = _ReentrantRegion.apply(self, _TensorOutputs(run, shape), *flat_args)
        return shape["rebuild"](tensors)

    # -- the non-re-entrant form ---------------------------------------------------------------------

    def non_reentrant_checkpoint(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)`, its saved tensors recomputed on first use in backward."""
        run, flat_args = bind_keywords(function, args, kwargs)
        if not torch.is_grad_enabled():
            return run(*flat_args)
        with self._boundary("forward"):
            state = _Recomputation(self, run, flat_args)
            with torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack):
                return run(*flat_args)

    # -- shared -------------------------------------------------------------------------------------

    def keep(self, args: tuple) -> KeptInputs:
        return KeptInputs(args, self.policy, self.offload, self.buffers, self.kept_bytes)

    def _boundary(self, phase: str) -> "_Boundary":
        return _Boundary(self, phase)


class _Boundary:
    """synchronize_checkpoint_boundary and profile around one forward or recomputation."""

    def __init__(self, checkpointer: Checkpointer, phase: str):
        self.settings, self.timings, self.phase = checkpointer.settings, checkpointer.timings, phase

    def __enter__(self) -> None:
        self._sync()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self._sync()
        if self.settings.profile:
            seconds = time.perf_counter() - self.start
            self.timings.append((self.phase, seconds))
            log.info("activation checkpoint %s: %.3f ms", self.phase, seconds * 1e3)

    def _sync(self) -> None:
        # Sync point (synchronize_checkpoint_boundary): the region's device work is finished. A CPU device
        # has no queued work, so there is nothing to wait for.
        if self.settings.synchronize_checkpoint_boundary and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


class _TensorOutputs:
    """Runs the region and returns only its tensor outputs; remembers (from the forward) how to rebuild the rest."""

    def __init__(self, run: Callable, shape: dict):
        self.run, self.shape = run, shape

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        tensors, rebuild = split_outputs(self.run(*args))
        self.shape.setdefault("rebuild", rebuild)
        return tensors


class _ReentrantRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, checkpointer: Checkpointer, run: _TensorOutputs, *args: Any):  # type: ignore[override]
        with checkpointer._boundary("forward"):
            ctx.checkpointer, ctx.run = checkpointer, run
            ctx.kept = checkpointer.keep(args)  # before the forward: a region may modify its input in place
            ctx.rng, ctx.autocast = RNGSnapshot.capture(checkpointer.tracker), capture_autocast()
            with torch.no_grad():
                outputs = run(*args)
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("the re-entrant checkpoint works with .backward() only, not torch.autograd.grad(); "
                               "use non_reentrant_checkpoint for autograd.grad")
        with ctx.checkpointer._boundary("backward"):
            inputs = ctx.kept.restore()
            ctx.kept = None  # the kept bytes go now: the restored inputs replace them
            with ctx.rng.restored(), torch.enable_grad(), autocast_as(ctx.autocast):
                outputs = ctx.run(*inputs)
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if isinstance(x, torch.Tensor) else None for x in inputs)


class _Placeholder:
    """Stands in the graph for one tensor the region saved; hashable by identity."""

    __slots__ = ("__weakref__",)


class _Recomputation:
    """The saved-tensor hooks of one non-re-entrant region: placeholders in forward, one recomputation in backward."""

    def __init__(self, checkpointer: Checkpointer, run: Callable, args: tuple):
        self.checkpointer, self.run = checkpointer, run
        self.kept: Optional[KeptInputs] = checkpointer.keep(args)
        self.rng, self.autocast = RNGSnapshot.capture(checkpointer.tracker), capture_autocast()
        self.placeholders: list[weakref.ref] = []
        self.values: "weakref.WeakKeyDictionary[_Placeholder, torch.Tensor]" = weakref.WeakKeyDictionary()

    def pack(self, tensor: torch.Tensor) -> _Placeholder:
        placeholder = _Placeholder()
        self.placeholders.append(weakref.ref(placeholder))
        return placeholder

    def unpack(self, placeholder: _Placeholder) -> torch.Tensor:
        if self.kept is not None:
            self._recompute()
        if placeholder not in self.values:
            raise RuntimeError("a tensor saved in a checkpointed region was used twice by backward (retain_graph, "
                               "or a double backward); the checkpoint recomputes once: run the region without "
                               "checkpointing for that")
        return self.values.pop(placeholder)

    def _recompute(self) -> None:
        with self.checkpointer._boundary("backward"):
            inputs = self.kept.restore()
            self.kept = None  # the kept bytes go now
            order = iter(self.placeholders)

            def fill(tensor: torch.Tensor) -> None:
                ref = next(order, None)
                if ref is None:
                    raise RuntimeError("the checkpointed region saved more tensors in its recomputation than in its "
                                       "forward: it is not deterministic (data-dependent control flow?)")
                placeholder = ref()
                if placeholder is not None:  # None: that node was already freed, nothing will ask for it
                    self.values[placeholder] = tensor

            def refuse(_: None) -> torch.Tensor:
                raise RuntimeError("the recomputation's own graph is never run backward")

            with self.rng.restored(), torch.enable_grad(), autocast_as(self.autocast), \
                    torch.autograd.graph.saved_tensors_hooks(fill, refuse):
                self.run(*inputs)
