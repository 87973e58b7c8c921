"""A Megatron-LM-style `mpu` module, written for the tests: module-level process groups set up by
`initialize_model_parallel(tensor_model_parallel_size)` and Megatron's getter functions (both spellings), as
Megatron-DeepSpeed's `megatron.core.parallel_state` / older `megatron.mpu` expose them. Scripts pass the module
itself as `mpu` to deepspeed.initialize and deepspeed.checkpointing.configure.

Layout as Megatron's: tensor-parallel groups are consecutive ranks, data-parallel groups strided.
"""

import torch.distributed as dist

_TENSOR_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> None:
    global _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = tensor_model_parallel_size
    assert world % tp == 0, f"world size {world} is not divisible by tensor-model-parallel size {tp}"
    for start in range(0, world, tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group
    for offset in range(tp):
        ranks = list(range(offset, world, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group


def model_parallel_is_initialized() -> bool:
    return _TENSOR_MODEL_PARALLEL_GROUP is not None


def get_tensor_model_parallel_group():
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(_TENSOR_MODEL_PARALLEL_GROUP)


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(_TENSOR_MODEL_PARALLEL_GROUP)


def get_data_parallel_group():
    return _DATA_PARALLEL_GROUP


def get_data_parallel_rank() -> int:
    return dist.get_rank(_DATA_PARALLEL_GROUP)


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(_DATA_PARALLEL_GROUP)


# the older names (Megatron-LM before tensor/pipeline split them)
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_world_size = get_tensor_model_parallel_world_size


def destroy_model_parallel() -> None:
    global _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    for group in (_TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP):
        dist.destroy_process_group(group)
    _TENSOR_MODEL_PARALLEL_GROUP = _DATA_PARALLEL_GROUP = None
