"""ZeRO-R's activation memory: checkpointed regions whose inputs are kept whole, partitioned across
the model-parallel group (Pa), offloaded to host memory (cpu), in constant buffers (CB), with the
random states that make a recomputation exact. See checkpointer.py; the DeepSpeed dialect is
zerodp.deepspeed.checkpointing; the configuration is `activation_checkpointing` (config/).

Modules:
    checkpointer.py          Activation checkpointing with ZeRO-R: a region's forward runs without saving its activations,
    contiguous.py            CB: kept checkpoint inputs copied into buffers allocated once, one slot per checkpointed ...
    host_offload.py          cpu_checkpointing: kept checkpoint inputs moved to host memory until their recomputation.
    kept_inputs.py           The inputs of one checkpointed region, as kept between its forward and its recomputation.
    model_parallel.py        The model-parallel (tensor-parallel) group that partitioned checkpoints are split across, read
    partition.py             Pa: a checkpointed input split across the model-parallel group, one 1/TP piece per rank.
    process_checkpointer.py  The process's checkpointing configuration: what `zerodp.activations.checkpoint` (and ...
    region.py                The calling convention of a checkpointed region: keyword arguments folded into positional ones,
    rng_tracker.py           Random-number states of a checkpointed region: the snapshot that lets a recomputation draw the ...
"""

from .checkpointer import Checkpointer
from .kept_inputs import DEVICE, HOST, KeptBytes
from .model_parallel import ModelParallelGroup
from .process_checkpointer import PROCESS, ProcessCheckpointing, checkpoint, non_reentrant_checkpoint
from .rng_tracker import MODEL_PARALLEL_RNG, RNGSnapshot, RNGStatesTracker, seed_model_parallel

__all__ = ["Checkpointer", "DEVICE", "HOST", "KeptBytes", "ModelParallelGroup", "MODEL_PARALLEL_RNG",
           "RNGSnapshot", "RNGStatesTracker", "seed_model_parallel", "PROCESS", "ProcessCheckpointing", "checkpoint",
           "non_reentrant_checkpoint"]
