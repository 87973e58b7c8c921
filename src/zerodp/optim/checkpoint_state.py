"""What checkpoints read and set of the sharded optimizer (`seams.CheckpointOptimizer`), per unit.

`ShardedOptimizer` keeps each unit's state the way torch's optimizer keeps it: one state dict per
chunk of the unit's fp32 master (elementwise optimizers) or per owned parameter (whole-tensor ones),
possibly streamed from an offload tier. These methods translate between that and the checkpoint's
form: one tensor shaped like the master per state key, plus scalars. Mixed into ShardedOptimizer (the
checkpoint side of its interface), whose public members they use (`chunks`, `whole`, `masters`, `units`,
`optimizer`, `offload`, `state_resident`, `chunk_ranges`, `step_counts`); kept apart so that the step's
module reads in one sitting.
"""

from __future__ import annotations

import torch


class CheckpointStateAccess:
    """The checkpoint side of `ShardedOptimizer` (module docstring)."""

    def state_of(self, index: int) -> dict:
        """Master `index`'s optimizer state: elementwise tensors shaped like the master (copies), and
        scalars (e.g. Adam's `step`). Empty before the first step."""
        with self.state_resident(index, write=False):  # copies are returned: the stored state is unchanged
            return self._state_of(index)

    def state_spec_of(self, index: int) -> tuple[dict[str, torch.dtype], dict]:
        """What `state_of(index)` would return, without reading offloaded state: the elementwise keys
        with their dtypes, and the scalars (copies). Checkpoints write a file's header from it."""
        if self.whole[index] or not self.chunks[index]:
            return {}, {}
        first = self.chunks[index][0]
        state = self.optimizer.state.get(first, {})
        elementwise = {k: v.dtype for k, v in state.items() if torch.is_tensor(v) and v.shape == first.shape}
        if self.offload is not None:
            elementwise.update(self.offload.stored_dtypes(self.offload.index[id(first)]))
        if not state and not elementwise:
            return {}, {}
        scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items() if k not in elementwise}
        return elementwise, scalars

    def _state_of(self, index: int) -> dict:
        if self.whole[index]:
            return {}  # per parameter, not per element: tensor_states_of
        states = [self.optimizer.state.get(c, {}) for c in self.chunks[index]]
        if not states[0]:
            return {}
        out = {}
        for key, value in states[0].items():
            if torch.is_tensor(value) and value.shape == self.chunks[index][0].shape:
                out[key] = torch.cat([st[key].reshape(-1) for st in states])
            else:
                out[key] = value.clone() if torch.is_tensor(value) else value
        return out

    def tensor_states_of(self, index: int) -> dict[int, dict]:
        """Whole-tensor unit `index`: each owned parameter's optimizer state (copies), keyed by its
        position in the unit's layout, exactly as torch keeps it for that parameter."""
        out = {}
        with self.state_resident(index, write=False):  # offload: the state shaped like its parameter is stored
            for seg, chunk in zip(self.units[index].layout.segments(self.units[index].shard_index),
                                  self.chunks[index]):
                state = self.optimizer.state.get(chunk, {})
                out[seg.param_index] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        return out

    def load_tensor_states_of(self, index: int, states: dict[int, dict]) -> None:
        """Replace the per-parameter state of whole-tensor unit `index` (the form `tensor_states_of` returns)."""
        with self.state_resident(index, read=False):
            for seg, chunk in zip(self.units[index].layout.segments(self.units[index].shard_index),
                                  self.chunks[index]):
                self.optimizer.state.pop(chunk, None)
                if states.get(seg.param_index):
                    self.optimizer.state[chunk] = {k: v.to(chunk.device) if torch.is_tensor(v) and v.dim() > 0
                                                   else v for k, v in states[seg.param_index].items()}

    def load_state_of(self, index: int, state: dict) -> None:
        """Replace master `index`'s optimizer state with `state` (the form `state_of` returns)."""
        with self.state_resident(index, read=False):  # replaced whole: the stored values are not needed
            self._load_state_of(index, state)

    def _load_state_of(self, index: int, state: dict) -> None:
        master = self.masters[index]
        self.step_counts.loaded_chunk_state(index, state)  # the unit's chunk count (optim/step_counts.py)
        self.step_counts.slice_steps.forget()  # no cached view may keep the replaced state alive (slice_steps.py)
        for chunk, chunk_sl, master_sl in self.chunk_ranges(index, 0, master.numel()):
            self.optimizer.state.pop(chunk, None)
            if state:
                self.optimizer.state[chunk] = {
                    k: (v[master_sl].clone() if torch.is_tensor(v) and v.shape == master.shape
                        else v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}

    def param_steps(self) -> dict[int, int]:
        """id(parameter) -> its own step count, for the parameters that keep one (optim/step_counts.py)."""
        return self.step_counts.by_param()

    def load_param_steps(self, saved) -> None:
        """Set the counts of `param_steps` form after the units' states are loaded (None: an older checkpoint
        without them; each parameter takes its chunk's count)."""
        self.step_counts.load(saved)

    def scalar_state_device(self, index: int) -> torch.device:
        """Where torch keeps master `index`'s scalar state tensors such as `step`: on the parameter's
        device for capturable or fused optimizers, on the CPU otherwise (torch's own load_state_dict rule)."""
        if not self.chunks[index]:
            return torch.device("cpu")
        first_chunk = self.chunks[index][0]
        for group in self.optimizer.param_groups:
            if any(p is first_chunk for p in group["params"]):
                fast = group.get("capturable") or group.get("fused")
                return self.masters[index].device if fast else torch.device("cpu")
        return torch.device("cpu")

    def load_master_from_shard(self, index: int) -> None:
        """Unit `index`'s parameter shard was written outside a step: make the master follow it."""
        unit, master = self.units[index], self.masters[index]
        if master is not unit.param_shard:
            with unit.resident():  # offload_param: the shard is read; it is not written
                master.copy_(unit.param_shard)
