"""A learning-rate schedule the caller brought (`initialize(lr_scheduler=...)`), as the engine steps it.

The caller's schedule is usually built on the caller's own optimizer, which never steps: the engine steps
its own copy over the master shards (optim/optimizer.py). `ClientSchedule` steps the caller's schedule after
every optimizer step taken and copies its group hyper-parameters (lr, betas, momentum, ...) into the
engine's optimizer, so the values the schedule sets are the values the step uses. A schedule built on the
engine's optimizer itself (DeepSpeed's callable form, or the config's `scheduler` section) needs no copy.
"""

from __future__ import annotations

from typing import Any


class ClientSchedule:
    """A scheduler object the user built on their own optimizer: stepped by the engine, its group
    hyper-parameters (lr, betas, momentum, ...) copied into the engine's optimizer after each step.
    `engine` is anything with the engine's `optimizer` (a ShardedOptimizer)."""

    def __init__(self, scheduler: Any, engine: Any) -> None:
        self.scheduler, self.engine = scheduler, engine
        self._sync()

    def _sync(self) -> None:
        source = getattr(self.scheduler, "optimizer", None)
        inner = self.engine.optimizer
        if source is None or source is inner.optimizer:
            return
        for inner_group, user_index in zip(inner.param_groups, inner.group_indices):
            inner_group.update({k: v for k, v in source.param_groups[user_index].items() if k != "params"})

    def step(self, *args, **kwargs) -> None:
        source = getattr(self.scheduler, "optimizer", None)
        if source is not None and source is not self.engine.optimizer.optimizer:
            # the user's optimizer never steps (the engine's master-shard copy does), so torch would warn that
            # the schedule steps before its optimizer; the engine has stepped by now
            source._opt_called = True
        self.scheduler.step(*args, **kwargs)
        self._sync()

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        self._sync()


def build_schedule(lr_scheduler: Any, engine: Any) -> Any:
    """The schedule `engine` steps for the caller's `lr_scheduler`: a callable without `step` is built on the
    engine's optimizer (DeepSpeed calls it with its basic optimizer); see `engine_schedule` for the rest."""
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(engine.optimizer.optimizer)
    return engine_schedule(lr_scheduler, engine)


def engine_schedule(schedule: Any, engine: Any) -> Any:
    """`schedule` as the engine keeps it: None stays None, one over the engine's own optimizer as it is, one
    over the caller's optimizer wrapped in `ClientSchedule`. Refuses an object that cannot be stepped."""
    if schedule is None or isinstance(schedule, ClientSchedule):
        return schedule
    if not callable(getattr(schedule, "step", None)):
        raise TypeError(f"lr_scheduler must have a step() method (a torch.optim.lr_scheduler or DeepSpeed "
                        f"schedule), got {type(schedule).__name__}")
    if getattr(schedule, "optimizer", None) is engine.optimizer.optimizer:
        return schedule
    return ClientSchedule(schedule, engine)
