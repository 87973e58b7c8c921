"""The bytes of model states one rank holds at each ZeRO stage, by design: the paper's formula.

With Psi parameters, N ranks, and per-parameter byte costs (param_bytes, grad_bytes, K = optimizer_bytes,
which includes an fp32 master copy if any):

    stage 0 (plain DP)    (param_bytes + grad_bytes + K) * Psi
    stage 1 (P_os)        (param_bytes + grad_bytes) * Psi + K * Psi / N
    stage 2 (P_os+g)      param_bytes * Psi + (grad_bytes + K) * Psi / N
    stage 3 (P_os+g+p)    (param_bytes + grad_bytes + K) * Psi / N

(Rajbhandari et al., SC20, section 3 and Table 1.) Pure arithmetic: no torch, no process group. The
engine's own report (report.py) compares what a rank holds against it; the planners (plan/formulas.py,
`zerodp estimate`) build their tables and limits on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states held by one rank."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: "ModelStateBytes") -> "ModelStateBytes":
        return ModelStateBytes(
            self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer
        )


def check_stage(world_size: int, stage: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def predict_model_state_bytes(
    numel: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes: float,
) -> ModelStateBytes:
    """Per-rank model-state bytes of ZeRO ``stage`` over ``world_size`` ranks (module formula)."""
    check_stage(world_size, stage)
    n = world_size
    return ModelStateBytes(
        params=numel * param_bytes / (n if stage >= 3 else 1),
        grads=numel * grad_bytes / (n if stage >= 2 else 1),
        optimizer=numel * optimizer_bytes / (n if stage >= 1 else 1),
    )
