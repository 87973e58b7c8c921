"""zerodp: ZeRO (Zero Redundancy Optimizer) data parallelism for PyTorch, switched on by config alone.

    engine = zerodp.initialize(model, optimizer, config)
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()
"""

from .adapters import install_public_name as _install_public_name

_install_public_name()  # `zerodp.deepspeed` names zerodp.adapters.deepspeed (zerodp/adapters/__init__.py)

from . import optim  # noqa: E402
from .config import ZeroConfig, load_config
from .checkpoint import consolidate_checkpoint, consolidate_tensor_parallel, save_consolidated
from .engine.zero_engine import ZeroEngine, initialize
from .errors import CheckpointError, ConfigError, DivergenceError, NonFiniteError, PartitionedParameterError
from .shard.stage3 import gathered_parameters, init_context

__all__ = ["initialize", "ZeroEngine", "ZeroConfig", "ConfigError", "load_config", "optim"]
__all__ += ["consolidate_checkpoint", "consolidate_tensor_parallel", "save_consolidated", "CheckpointError", "NonFiniteError", "DivergenceError"]
__all__ += ["gathered_parameters", "init_context", "PartitionedParameterError"]
__version__ = "0.1.0"
