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
exactly that. Only `install()` adds it: a plain `import zerodp` leaves importlib.metadata untouched, and
an installed DeepSpeed's own metadata is never consulted while the alias is in place (the finder comes
first), so the version seen always matches the module that `import deepspeed` gives.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import pkgutil
import sys
from pathlib import Path

ALIAS = "deepspeed"
TARGET = "zerodp.deepspeed"
# modules a script may run through `python -m zerodp.deepspeed.run`, not part of DeepSpeed's namespace
_OWN = {"alias", "run"}
# the DeepSpeed release zerodp.deepspeed follows (tests/e2e/deepspeed_scripts/expected_deepspeed.json)
DEEPSPEED_VERSION = "0.19.8"


class _RefuseUncovered(importlib.abc.MetaPathFinder):
    """Refuse `deepspeed.*` modules zerodp does not provide, naming the module (placed after sys.modules)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(ALIAS + "."):
            raise ModuleNotFoundError(f"{fullname} is not provided by zerodp.deepspeed (see the README's "
                                      f"'Switching from DeepSpeed' for the modules covered)", name=fullname)
        return None


class AliasDistribution(importlib.metadata.Distribution):
    """The `deepspeed` distribution as importlib.metadata sees it under the alias: name, version and the
    top-level package, nothing else (no files: `files` is None, as for a distribution without a RECORD)."""

    _FILES = {
        "METADATA": (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {DEEPSPEED_VERSION}\n"
                     f"Summary: {TARGET} (zerodp) presented as DeepSpeed {DEEPSPEED_VERSION} by its module alias\n"),
        "top_level.txt": f"{ALIAS}\n",
    }

    def read_text(self, filename):
        return self._FILES.get(filename)

    def locate_file(self, path):
        return Path(importlib.import_module(TARGET).__file__).parent / path


class _AliasDistributionFinder(importlib.abc.MetaPathFinder):
    """importlib.metadata's finder for the alias's `deepspeed` distribution; imports nothing (find_spec: None)."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        # a query for every distribution (name None) lists it too; names compare normalized, as PEP 503 does
        name = context.name
        if name is None or name.replace("_", "-").replace(".", "-").lower() == ALIAS:
            return iter([AliasDistribution()])
        return iter([])


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
