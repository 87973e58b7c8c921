"""`ZeroOptimizer`: the optimizer `deepspeed.initialize` returns, as frameworks use DeepSpeed's ZeRO optimizer.

PyTorch Lightning keeps it as the run's optimizer (wrapped in its `LightningOptimizer`) and calls
`zero_grad()` before each accumulation window, reads `param_groups` (its lr monitor) and `state` (moving
optimizer states between devices at teardown) and `state_dict()` when it writes a checkpoint (then
leaves that out: the engine's checkpoint holds the optimizer). What each means here, as in DeepSpeed:
  - `optimizer`: the basic (inner) torch optimizer, which steps this rank's fp32 master shards;
  - `param_groups`, `state`: that optimizer's groups and per-shard state (keyed by master shards);
  - `state_dict()`: this rank's inner optimizer state (rank-local, as DeepSpeed's ZeRO optimizer's);
  - `zero_grad()`: the engine zeroes gradients at each optimizer step, so at a step boundary there is
    nothing to zero; inside an accumulation window it would drop what was accumulated, and is refused;
  - `step()` / `load_state_dict()` directly: refused, naming `engine.step()` / `engine.load_checkpoint`.
Anything else is zerodp's `ShardedOptimizer` (e.g. `last_grad_norm`).
"""

from __future__ import annotations

from ...engine.zero_engine import ZeroEngine


class ZeroOptimizer:
    """DeepSpeed's ZeRO-optimizer surface over a zerodp engine's sharded optimizer."""

    def __init__(self, engine: ZeroEngine) -> None:
        self._engine = engine

    @property
    def optimizer(self):
        return self._engine.optimizer.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self._engine.optimizer.param_groups

    @property
    def state(self):
        return self._engine.optimizer.optimizer.state

    def state_dict(self) -> dict:
        return self._engine.optimizer.optimizer.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._engine.at_step_boundary:
            raise RuntimeError("optimizer.zero_grad() inside a gradient accumulation window would drop the gradients "
                               "accumulated since the last step; zerodp zeroes them at each engine.step() boundary, "
                               "so call zero_grad() only between optimizer steps (or not at all)")

    def step(self, closure=None) -> None:
        raise RuntimeError("call engine.step() after engine.backward(loss): the engine steps this optimizer at each "
                           "accumulation boundary (optimizer.step() directly would skip the gradient reduction)")

    def load_state_dict(self, state_dict: dict) -> None:
        raise RuntimeError("the optimizer state is restored by engine.load_checkpoint(dir), with the model's "
                           "(zerodp's checkpoints hold every rank's shard); optimizer.load_state_dict is not supported")

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_engine"].optimizer, name)
