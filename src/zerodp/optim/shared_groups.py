"""The user's param groups are the inner optimizer's groups: one dict per group, shared.

zerodp steps an optimizer rebuilt over this rank's master shards (inner.py), not the one the user passed.
Callers still change hyper-parameters through the optimizer they built: a torch scheduler made on it
(before or after `initialize`: Accelerate steps StepLR / LambdaLR on the user's optimizer), or a loop
writing `group["lr"]`. For every such change to reach the step, the rebuilt optimizer's groups *are* the
user's group dicts: after the rebuild, each user group dict takes the inner group's contents (its `params`
become the master-shard chunks, its hyper-parameters stay the user's) and replaces the inner dict in the
inner optimizer's list. Both optimizers then read and write the same dicts: nothing is copied at a step,
and nothing can go stale in either direction (a checkpoint's restored lr, a config scheduler's lr, show in
the user's groups too).

This is what DeepSpeed does with the optimizer it is given (its ZeRO optimizer points the basic optimizer's
groups at flat fp32 partitions), so the user's `param_groups[i]["params"]` holds zerodp's shards after
`initialize`, as under DeepSpeed. Groups without trainable parameters are not stepped and keep their
parameters. Anything that keeps a group dict (not the optimizer) sees the same dict, since it is the
user's own object that survives.
"""

from __future__ import annotations

from typing import Any

from ..errors import OptimizerError
from ..optimizers.larc import LARC
from ..optimizers.optimizer_list import OptimizerList


def _group_slots(optimizer: Any) -> list[tuple[list, int]]:
    """(list, position) of each group of `optimizer.param_groups`, in order, in the list that really holds it
    (a member's own list for an OptimizerList, the wrapped optimizer's for LARC)."""
    if isinstance(optimizer, OptimizerList):
        return [slot for member in optimizer.optimizers for slot in _group_slots(member)]
    if isinstance(optimizer, LARC):
        return _group_slots(optimizer.optim)
    return [(optimizer.param_groups, k) for k in range(len(optimizer.param_groups))]


class SharedGroups:
    """The link between the user's optimizer and the inner one: `verify()` before each step refuses, loudly, a
    user optimizer whose group dicts were replaced since (torch's `load_state_dict` and `add_param_group` on it
    make new ones), since changes to those would no longer reach the step."""

    def __init__(self, user_optimizer: Any, shared: list[dict]) -> None:
        self.user_optimizer, self.shared = user_optimizer, shared
        self.count = len(user_optimizer.param_groups)

    def before_step(self) -> None:
        """Called as each step starts: `verify()`, then mark the user's optimizer as stepped, as torch's scheduler
        wrapper of its `step` does, since its groups are being stepped (a scheduler on it would otherwise warn that
        it steps before its optimizer ever did)."""
        self.verify()
        for optimizer in (self.user_optimizer, getattr(self.user_optimizer, "optim", None),
                          *getattr(self.user_optimizer, "optimizers", ())):
            if optimizer is not None:
                optimizer._opt_called = True

    def verify(self) -> None:
        groups = self.user_optimizer.param_groups
        current = {id(g) for g in groups}
        if len(groups) != self.count or any(id(g) not in current for g in self.shared):
            raise OptimizerError(
                "the optimizer passed to initialize has new param groups since (load_state_dict or add_param_group "
                "on it): zerodp steps the groups it had, so changes to the new ones would not reach training. Change "
                "hyper-parameters in place (group['lr'] = ...), restore state with engine.load_checkpoint, and "
                "build a new engine to train other parameters")


def share_param_groups(user_optimizer: Any, inner_optimizer: Any, group_indices: list[int]) -> SharedGroups:
    """Make the inner optimizer's group j the user's group dict `group_indices[j]` (module docstring).

    Called once, right after the inner optimizer is built and before anything else reads its groups."""
    user_groups = user_optimizer.param_groups
    slots = _group_slots(inner_optimizer)
    if len(slots) != len(group_indices):
        raise AssertionError(f"{len(slots)} inner groups for {len(group_indices)} kept user groups")
    for (holder, position), user_index in zip(slots, group_indices):
        shared, inner = user_groups[user_index], holder[position]
        if shared is inner:
            continue
        # the inner group was built from this dict's hyper-parameters (plus the class's defaults it lacked)
        shared.pop("param_names", None)  # names of the model's parameters, not of the shards it now holds
        shared.update(inner)
        holder[position] = shared
    return SharedGroups(user_optimizer, [user_groups[i] for i in group_indices])
