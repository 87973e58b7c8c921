"""VISSL's defaults for the keys zerodp reads, as VISSL's `vissl/config/defaults.yaml` sets them.

A key absent from a user's VISSL file takes the value VISSL itself would use (momentum 0.9, weight
decay 1e-4, LARC trust coefficient 1e-3, ...), never zero. tests/unit/config/test_config_vissl.py checks
every value here against the copy of defaults.yaml kept in tests/configs/vissl/.
"""

from __future__ import annotations

_LR_SCHEDULE = {
    "auto_lr_scaling": {"auto_scale": False, "base_value": 0.1, "base_lr_batch_size": 256, "scaling_type": "linear"},
    "name": "multistep",
    "update_interval": "epoch",
    "values": [0.1, 0.01, 0.001],
    "milestones": [30, 60],
    "schedulers": [],
    "interval_scaling": [],
    "lengths": [],
    "start_value": 0.1,
    "end_value": 0.0,
    "value": 0.1,
}

VISSL_DEFAULTS: dict = {
    "OPTIMIZER": {
        "name": "sgd",
        "use_zero": False,
        "use_larc": False,
        "larc_config": {"clip": False, "eps": 1e-08, "trust_coefficient": 0.001},
        "weight_decay": 0.0001,
        "momentum": 0.9,
        "nesterov": False,
        "num_epochs": 90,
        "betas": [0.9, 0.999],
        "regularize_bn": False,
        "regularize_bias": True,
        "non_regularized_parameters": [],
        "head_optimizer_params": {"use_different_lr": False, "use_different_wd": False, "weight_decay": 0.0001},
        "param_schedulers": {"lr": _LR_SCHEDULE, "lr_head": _LR_SCHEDULE},
        "construct_single_param_group_only": False,
        "param_group_constructor": "default",
        "layer_wise_lr_decay": {"decay": 0.9},
    },
    "MODEL": {
        "SHARDED_DDP_SETUP": {"USE_SDP": False, "reduce_buffer_size": -1},
        "FSDP_CONFIG": {
            "AUTO_SETUP_FSDP": False,
            "AUTO_WRAP_THRESHOLD": 0,
            "AMP_TYPE": "01",
            "FORCE_SYNC_CUDA": False,
            "flatten_parameters": True,
            "mixed_precision": True,
            "fp32_reduce_scatter": False,
            "compute_dtype": "float32",
            "bucket_cap_mb": 0,
            "clear_autocast_cache": True,
            "verbose": True,
        },
        "AMP_PARAMS": {"USE_AMP": False, "AMP_ARGS": {"opt_level": "O1"}, "AMP_TYPE": "apex"},
        "GRAD_CLIP": {"USE_GRAD_CLIP": False, "NORM_TYPE": 2, "MAX_NORM": 1},
    },
    "DATA": {"TRAIN": {"BATCHSIZE_PER_REPLICA": 256}},
    "DISTRIBUTED": {"NUM_NODES": 1, "NUM_PROC_PER_NODE": 8},
    "TRAINER": {"TASK_NAME": "self_supervision_task"},
}
