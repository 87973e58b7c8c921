"""torch's update of slices of flat chunks, each slice with its own step count: `SliceSteps`.

step_counts.py steps the parameters that missed a step, or got a gradient behind their chunk's count, on their
own ([Note: sliced chunks] there): one step of the user's optimizer class, with its group's options, over views
of the chunks (as parameters), of their gradients (as .grad) and of their state, each view with its own `step`.
torch updates the views in place, so the result lands in the chunks themselves: no copy in, none back.

What does not change from one step to the next is kept (a 64-expert MoE steps ~40 such slices at every step):
  - one temporary optimizer per inner group, built once: at each step its group takes the inner group's options
    anew (a schedule changes `lr`) and its parameters and state are the step's slices; both are emptied after
    the step, so it holds no view of a gradient or of offloaded state between steps;
  - per chunk, the views of its state, made again when the chunk's state tensors are not those they view (a
    checkpoint load, an offload window that brought the state back into other buffers; `forget` drops them all),
    and per slice, the view of the chunk and a `step` tensor of its own; torch advances it by one in place, so the
    host knows its value after a step and fills it only when the slice's count is another (a parameter stepped
    at consecutive steps is not);
  - all of it in one foreach call per group, the chunks stepped whole beside the slices.
A slice's gradient view is made at every step: the gradient is a new tensor each time. An int `step` (zerodp's
FusedAdam) or a chunk without state yet gets views made for the step alone.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .inner import rebuild

# views kept at most (slices of chunks seen): a model whose slices vary without bound cannot grow this forever
MAX_CACHED_SLICES = 1 << 14


class _SliceViews:
    """One slice's cached views: of the chunk (`leaf`), of its state tensors (`state`), and its own `step` tensor
    with the value it holds as far as the host knows (None: unknown, filled before use)."""

    __slots__ = ("leaf", "state", "step", "value")

    def __init__(self, leaf: torch.Tensor, state: dict, step: Optional[torch.Tensor]) -> None:
        self.leaf, self.state, self.step, self.value = leaf, state, step, None


class _ChunkViews:
    """One chunk's cached views, valid while `bases` are its state's tensors and `step` its state's `step` tensor;
    per slice (start, stop), a `_SliceViews`."""

    __slots__ = ("chunk", "bases", "step", "length", "slices")

    def __init__(self, chunk: torch.Tensor, state: dict) -> None:
        self.chunk = chunk
        # the elementwise state, shaped like the chunk (Adam's exp_avg, exp_avg_sq, amsgrad's max_exp_avg_sq)
        self.bases = tuple((k, v) for k, v in state.items() if torch.is_tensor(v) and v.shape == chunk.shape)
        step = state.get("step")
        self.step = step if torch.is_tensor(step) else None  # an int `step` (FusedAdam) is made per step
        self.length = len(state)
        self.slices: dict[tuple[int, int], _SliceViews] = {}

    def valid(self, chunk: torch.Tensor, state: dict) -> bool:
        return (self.chunk is chunk and len(state) == self.length and state.get("step") is self.step is not None
                and all(state.get(k) is v for k, v in self.bases))

    def new_slice(self, csl: slice) -> _SliceViews:
        # torch's kind of `step` (a CPU float tensor; on the device for fused/capturable): its own, not shared
        views = self.slices[(csl.start, csl.stop)] = _SliceViews(self.chunk[csl], {k: v[csl] for k, v in self.bases},
                                                                 torch.empty_like(self.step))
        return views


class SliceSteps:
    """One optimizer step over slices of chunks, each with its own count (module docstring)."""

    def __init__(self) -> None:
        self._temps: dict[int, tuple[Any, torch.optim.Optimizer]] = {}  # inner group -> (its member, the temporary)
        self._views: dict[int, _ChunkViews] = {}                        # id(chunk) -> its cached views
        self._cached = 0                                                # slices made since the last forget

    def forget(self) -> None:
        """Drop every cached view (the chunks' state was replaced: a checkpoint load)."""
        self._views.clear()
        self._cached = 0

    @torch.no_grad()
    def step(self, group_index: int, member, group: dict, states, slices: list) -> None:
        """Step `slices` ((chunk, slice, count) of inner group `group_index`, whose optimizer is `member`), each with
        its count, as torch steps a parameter of that count. A chunk with no state yet gives its slices fresh state,
        as torch would, which is dropped afterwards. (chunk, None, None): the chunk itself, with its gradient and
        its own state, which torch updates as the inner optimizer would (its `step` included)."""
        leaves, own_states, sliced, counted = [], [], [], []
        chunk_views: dict[int, Optional[_ChunkViews]] = {}  # this step's chunks, checked once each
        for chunk, csl, count in slices:
            state = states.get(chunk)
            if csl is None:
                leaves.append(chunk)
                own_states.append(state)
                continue
            views = chunk_views.get(id(chunk), False)
            if views is False:
                views = chunk_views[id(chunk)] = self._chunk(chunk, state)
            if views is None:  # no state yet, or an int `step`: views and step made for this step only
                leaf, own = chunk[csl], None
                if state:
                    own = {k: v[csl] for k, v in state.items() if torch.is_tensor(v) and v.shape == chunk.shape}
                    step = state.get("step")
                    own["step"] = torch.full_like(step, float(count)) if torch.is_tensor(step) else type(step)(count)
            else:
                cached = views.slices.get((csl.start, csl.stop))
                if cached is None:
                    cached = views.new_slice(csl)
                    self._cached += 1
                if cached.value != count:
                    cached.step.fill_(float(count))
                leaf, own = cached.leaf, dict(cached.state, step=cached.step)
                cached.value = None  # unknown until the step returns
                counted.append((cached, count))
            leaf.grad = chunk.grad[csl]
            leaves.append(leaf)
            own_states.append(own)
            sliced.append(leaf)
        temp = self._temp(group_index, member, group, leaves)
        for leaf, own in zip(leaves, own_states):
            if own is not None:
                temp.state[leaf] = own
        try:
            temp.step()
            for cached, count in counted:
                cached.value = count + 1  # torch's Adam advances each `step` it steps by one, in place
        finally:  # nothing of this step stays referenced: gradients may be freed, state evicted to its store
            for leaf in sliced:
                leaf.grad = None
            temp.state.clear()
            temp.param_groups[0]["params"] = []
        if self._cached > MAX_CACHED_SLICES:
            self.forget()

    def _chunk(self, chunk: torch.Tensor, state: Optional[dict]) -> Optional[_ChunkViews]:
        """The chunk's cached views, made again if its state is not what they view; None: not cached (no state, or
        an int `step`)."""
        if not state or not torch.is_tensor(state.get("step")):
            return None
        views = self._views.get(id(chunk))
        if views is None or not views.valid(chunk, state):
            views = self._views[id(chunk)] = _ChunkViews(chunk, state)
        return views

    def _temp(self, group_index: int, member, group: dict, leaves: list) -> torch.optim.Optimizer:
        """The temporary optimizer of this group over `leaves`, with the group's current options."""
        options = {k: v for k, v in group.items() if k != "params"}
        kept = self._temps.get(group_index)
        if kept is None or kept[0] is not member:
            temp = rebuild(member, [dict(options, params=leaves)])
            self._temps[group_index] = (member, temp)
            return temp
        temp = kept[1]
        temp.param_groups[0].update(options)
        temp.param_groups[0]["params"] = leaves
        return temp
