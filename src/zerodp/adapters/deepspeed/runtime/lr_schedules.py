"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedule classes and `VALID_LR_SCHEDULES`, the names of the
schedules a config's `scheduler.type` may take.

Accelerate reads `VALID_LR_SCHEDULES` to decide where a scheduler goes: one whose class is named there is handed
to `deepspeed.initialize(lr_scheduler=...)` and stepped by the engine; any other (torch's StepLR, LambdaLR) stays
with the user, stepped on the optimizer the user built, whose param groups zerodp steps (optim/shared_groups.py).
The classes are zerodp's own (optim/lr_schedules.py), with DeepSpeed's arguments and formulas.
"""

from ....optimizers.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR"]
