"""Every exception zerodp raises on purpose, in one place, so any module (and any user) can catch them.

Each message names the problem and the fix in one line (a config error may list one line per key).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


class LaunchError(ConfigError):
    """The launcher's environment shows a job of several processes but cannot form one world (comm/launch_env.py);
    the message names the variables seen and the fix."""


class OptimizerError(ValueError):
    """An optimizer zerodp cannot step exactly on flat shards (or an ambiguous optimizer setup)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found or used; the message says which file and why."""


class PartitionedParameterError(RuntimeError):
    """A sharded (ZeRO stage 3) parameter was read outside a gather."""


class UsageError(Exception):
    """A command-line mistake: printed as one line on stderr, exit code 2."""


class NonFiniteError(FloatingPointError):
    """A NaN or Inf reached the gradients under `nonfinite: stop`; the message names where."""


class DivergenceError(RuntimeError):
    """Ranks were about to issue different collectives (debug_sync); the message says which."""
