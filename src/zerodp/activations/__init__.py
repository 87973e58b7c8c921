"""ZeRO-R's activation memory: checkpointed regions whose inputs are kept whole, partitioned across
the model-parallel group (Pa), offloaded to host memory (cpu), in constant buffers (CB), with the
random states that make a recomputation exact. See checkpointer.py; the DeepSpeed dialect is
zerodp.deepspeed.checkpointing; the configuration is `activation_checkpointing` (config/).
"""

from .checkpointer import Checkpointer
from .kept_inputs import DEVICE, HOST, KeptBytes
from .model_parallel import ModelParallelGroup
from .process_checkpointer import PROCESS, ProcessCheckpointing, checkpoint, non_reentrant_checkpoint
from .rng_tracker import MODEL_PARALLEL_RNG, RNGSnapshot, RNGStatesTracker, seed_model_parallel

__all__ = ["Checkpointer", "DEVICE", "HOST", "KeptBytes", "ModelParallelGroup", "MODEL_PARALLEL_RNG",
           "RNGSnapshot", "RNGStatesTracker", "seed_model_parallel", "PROCESS", "ProcessCheckpointing", "checkpoint",
           "non_reentrant_checkpoint"]
