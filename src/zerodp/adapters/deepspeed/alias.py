"""Run a DeepSpeed script unchanged: make `import deepspeed` and `from deepspeed.X import Y` resolve to
`zerodp.deepspeed` and its submodules.

`install()` imports every submodule of zerodp.deepspeed (each imports without side effects) and registers
it in `sys.modules` under DeepSpeed's name, so `import deepspeed.comm as dist` finds `zerodp.deepspeed.comm`
(an installed DeepSpeed is never imported: `sys.modules` is consulted first). Any other `deepspeed.*`
module is refused by a finder with one line naming it (e.g. `deepspeed.pipe`: pipeline parallelism).
`python -m zerodp.deepspeed.run script.py ARGS` calls `install()` and runs the script (see run.py).

The alias also presents zerodp as the installed `deepspeed` *distribution* to code that asks package
metadata rather than `sys.modules`: `importlib.metadata.version("deepspeed")` answers `DEEPSPEED_VERSION`
(the DeepSpeed release whose behaviour zerodp.deepspeed follows and whose losses the script tests compare
with). transformers' `HfDeepSpeedConfig` (DeepSpeed-Chat at stage 3) and `is_deepspeed_available()` check
exactly that. Only the alias adds it: a plain `import zerodp` leaves importlib.metadata untouched, and
an installed DeepSpeed's own metadata is never consulted while the alias is in place (the finder comes
first), so the version seen always matches the module that `import deepspeed` gives.

ZERODP_DEEPSPEED_ALIAS=1 gives every process the alias from start-up (src/_zerodp_deepspeed_alias.py, which
calls `install()` at the first `import deepspeed`); `zerodp.deepspeed.run` sets it for the processes a script
starts (docs/frameworks.md).
"""

from __future__ import annotations

import importlib
import importlib.abc
import pkgutil
import sys

# the names and the distribution live in a top-level module that imports no torch: the start-up hook of
# ZERODP_DEEPSPEED_ALIAS=1 (every process a launcher starts) uses them before zerodp is imported
from _zerodp_deepspeed_alias import ALIAS, DEEPSPEED_VERSION, TARGET, AliasDistribution  # noqa: F401
from _zerodp_deepspeed_alias import AliasDistributionFinder as _AliasDistributionFinder

# modules a script may run through `python -m zerodp.deepspeed.run`, not part of DeepSpeed's namespace
_OWN = {"alias", "run"}


class _RefuseUncovered(importlib.abc.MetaPathFinder):
    """Refuse `deepspeed.*` modules zerodp does not provide, naming the module (placed after sys.modules)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(ALIAS + "."):
            raise ModuleNotFoundError(f"{fullname} is not provided by zerodp.deepspeed (see docs/deepspeed.md "
                                      f"for the modules covered)", name=fullname)
        return None


def submodules() -> list[str]:
    """The dotted names (relative to zerodp.deepspeed) of every submodule the alias covers."""
    package = importlib.import_module(TARGET)
    names = []
    for info in pkgutil.walk_packages(package.__path__, prefix=TARGET + "."):
        name = info.name[len(TARGET) + 1:]
        if name.split(".")[0] not in _OWN:
            names.append(name)
    return names


def install() -> None:
    """Register zerodp.deepspeed and its submodules as `deepspeed` and `deepspeed.*`, and the `deepspeed`
    distribution for importlib.metadata (idempotent)."""
    sys.modules[ALIAS] = importlib.import_module(TARGET)
    for name in submodules():
        sys.modules[f"{ALIAS}.{name}"] = importlib.import_module(f"{TARGET}.{name}")
    if not any(isinstance(finder, _RefuseUncovered) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RefuseUncovered())
    if not any(isinstance(finder, _AliasDistributionFinder) for finder in sys.meta_path):
        # first, so that an installed DeepSpeed's metadata (another version, another module) is not found
        sys.meta_path.insert(0, _AliasDistributionFinder())
