"""`deepspeed.compression`: only `helper`'s two module-path helpers, which DeepSpeed-Chat's LoRA code imports.

DeepSpeed's compression methods themselves (`compress.init_compression`, quantization and pruning
schedules) are not provided: importing `deepspeed.compression.compress` fails naming the module.

Modules:
    helper.py  `deepspeed.compression.helper.recursive_getattr` / `recursive_setattr`: reach a submodule by ...
"""

from . import helper

__all__ = ["helper"]
