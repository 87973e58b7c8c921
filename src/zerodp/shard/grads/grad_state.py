"""The states of one gradient shard's life cycle (`grads.grad_shard.GradShard`) and the transitions allowed:

    IDLE --add_grad--> FILLING --launch--> REDUCING --wait--> REDUCED
      \\_______________launch______________/                     |
    REDUCED --add_grad/launch--> (a new round: FILLING/REDUCING)  |  zero_grad: any state -> IDLE

Every transition is checked against `ALLOWED`; an illegal sequence fails with the two states named
instead of hanging in a collective. A second round in one micro-step happens when a gradient
arrives after its shard's reduction (a weight used in two re-entrant checkpointed regions) or when
another rank had such a gradient (see `reduce_queue.ReduceQueue.finish`).
"""

from __future__ import annotations

from enum import Enum, auto


class GradState(Enum):
    IDLE = auto()       # no gradient this round
    FILLING = auto()    # some parameters reported
    REDUCING = auto()   # reduction launched, not yet waited on
    REDUCED = auto()    # this round's reduction is in `shard`


ALLOWED = {
    GradState.IDLE: {GradState.IDLE, GradState.FILLING, GradState.REDUCING},
    GradState.FILLING: {GradState.FILLING, GradState.REDUCING, GradState.IDLE},
    GradState.REDUCING: {GradState.REDUCED},
    GradState.REDUCED: {GradState.IDLE, GradState.FILLING, GradState.REDUCING},
}
