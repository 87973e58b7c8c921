"""DeepSpeed's `activation_checkpointing` section: how checkpointed activations are kept (ZeRO-R).

Keys, defaults and meanings are DeepSpeed's (its config reference and
runtime/activation_checkpointing/config.py), so a Megatron-DeepSpeed or gpt-neox config works
unchanged. The section says *how* a checkpointed region keeps its inputs between forward and
backward; *which* regions are checkpointed is the model's code (`zerodp.activations.checkpoint`,
`zerodp.deepspeed.checkpointing.checkpoint`, or `zerodp train --checkpoint-activations`).
The mechanism is zerodp.activations; where zerodp departs from DeepSpeed is in docs/activations.md.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from .strict import StrictModel


class ActivationCheckpointingConfig(StrictModel):
    """`activation_checkpointing`: the ZeRO paper's Pa (partitioned checkpoints), Pa+cpu and CB."""

    partition_activations: bool = Field(False, description="Pa: each rank of the model-parallel (tensor-parallel) "
                                        "group keeps 1/TP of every checkpointed input, all-gathered again in "
                                        "backward. Needs a model-parallel group (an mpu); without one it is an "
                                        "error, since there is nothing to partition across.")
    cpu_checkpointing: bool = Field(False, description="Keep checkpointed inputs in host memory (pinned and copied "
                                    "on a side stream on CUDA) and bring them back for the recomputation. Works "
                                    "with or without partition_activations (with it: Pa+cpu, each rank's 1/TP "
                                    "goes to the host). On a CPU device the inputs move to a separate host "
                                    "buffer: the same path, no memory saved.")
    contiguous_memory_optimization: bool = Field(False, description="CB: copy the kept inputs into buffers "
                                                 "allocated once (number_checkpoints slots per input position), so "
                                                 "long-lived checkpoints do not interleave with short-lived "
                                                 "activations. Works with or without partitioning.")
    number_checkpoints: Optional[int] = Field(None, gt=0, description="Checkpointed regions per forward (the "
                                              "contiguous buffers' slot count). Unset with "
                                              "contiguous_memory_optimization: learned from the first forward "
                                              "(DeepSpeed asserts instead); set: more regions in one forward "
                                              "is an error.")
    synchronize_checkpoint_boundary: bool = Field(False, description="Synchronize the device at the start and end "
                                                  "of every checkpointed region's forward and recomputation "
                                                  "(debugging and timing; nothing to wait for on a CPU device).")
    profile: bool = Field(False, description="Log each checkpointed region's forward and backward time "
                          "(checkpointer.timings keeps them).")

    @model_validator(mode="after")
    def _count_needs_buffers(self) -> "ActivationCheckpointingConfig":
        if self.number_checkpoints is not None and not self.contiguous_memory_optimization:
            raise ValueError(f"number_checkpoints={self.number_checkpoints} sizes the contiguous buffers, and "
                             f"contiguous_memory_optimization is false, so it would have no effect: remove it, or "
                             f"set contiguous_memory_optimization to true")
        return self

    @property
    def keeps_whole_on_device(self) -> bool:
        """True when inputs are kept as plain checkpointing keeps them (whole, where they were computed)."""
        return not (self.partition_activations or self.cpu_checkpointing or self.contiguous_memory_optimization)
