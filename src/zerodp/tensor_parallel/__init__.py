"""Tensor (model) parallelism in Megatron's style, so ZeRO can shard over the data-parallel dimension of a
2-D layout (the ZeRO paper's 100B-class setting): `mpu.py` (the process groups, Megatron's names),
`mappings.py` (the f/g operators), `layers.py` (column/row-parallel linears, vocab-parallel embedding),
`cross_entropy.py`, `random.py` (the model-parallel RNG tracker), `layout.py` (which parameters are
sharded and how: slicing and merging). Depends on torch only: zerodp.tools.models builds on it.

Modules:
    cross_entropy.py  Cross entropy over logits whose vocabulary is split across the tensor-parallel group ...
    layers.py         Megatron's tensor-parallel layers: column- and row-parallel linears and a vocab-parallel ...
    layout.py         Where a tensor-parallel parameter's shards sit in the whole parameter: `ShardSpec`, and the ...
    mappings.py       The four communication operators of Megatron's tensor parallelism, as autograd functions.
    mpu.py            The model-parallel unit (Megatron's "mpu"): which ranks hold tensor-parallel shards of one ...
    random.py         Model-parallel random streams (Megatron's `CudaRNGStatesTracker`, DeepSpeed's ...
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .layout import (ShardSpec, merge_shards, merge_state_dicts, shard_tensor, sharded_parameter_ids,
                     tensor_parallel_specs)
from .mappings import (copy_to_tensor_parallel, gather_from_tensor_parallel, reduce_from_tensor_parallel,
                       scatter_to_tensor_parallel)
from .mpu import ModelParallelUnit
from .random import MODEL_PARALLEL_RNG, RNGStatesTracker, seed_model_parallel

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "ShardSpec", "merge_shards", "merge_state_dicts", "shard_tensor", "sharded_parameter_ids",
           "tensor_parallel_specs", "copy_to_tensor_parallel", "gather_from_tensor_parallel",
           "reduce_from_tensor_parallel", "scatter_to_tensor_parallel", "ModelParallelUnit", "MODEL_PARALLEL_RNG",
           "RNGStatesTracker", "seed_model_parallel"]
