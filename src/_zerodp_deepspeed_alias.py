"""The `deepspeed` alias at interpreter start-up, switched on by ZERODP_DEEPSPEED_ALIAS=1 for a process and
every process it starts (torchrun's ranks, Lightning's rank 1, `accelerate launch`'s launcher and ranks).

zerodp installs `zerodp-deepspeed-alias.pth` beside this module in site-packages. Python runs its one line
at every start-up: it reads the variable and, when it is "1", calls `enable()`; unset, that is one
dictionary look-up (no import). `enable()` imports nothing heavy either: it puts two finders first on
`sys.meta_path`,
  - `LazyAlias`: the first `import deepspeed` (or `importlib.util.find_spec("deepspeed")`) finds a module
    whose loading runs `zerodp.deepspeed.alias.install()`, which puts zerodp.deepspeed and its submodules
    in `sys.modules` under DeepSpeed's names; torch and zerodp are imported then, not at start-up;
  - `AliasDistributionFinder`: `importlib.metadata.version("deepspeed")` answers DEEPSPEED_VERSION, so a
    framework that asks for the distribution before importing it (accelerate's `is_deepspeed_available`,
    transformers' version checks) finds it.
Both come before the path finders, so an installed DeepSpeed is never imported while the variable is
set (the switch is explicit: the alias wins, see docs/frameworks.md).

This module is top level, not in the zerodp package, because importing anything under `zerodp` imports
torch (1.5 s): start-up under the switch stays cheap for processes that never import deepspeed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

ENV = "ZERODP_DEEPSPEED_ALIAS"
ALIAS = "deepspeed"
TARGET = "zerodp.adapters.deepspeed"  # importable as zerodp.deepspeed too (zerodp/adapters/__init__.py)
# the DeepSpeed release zerodp.deepspeed follows (tests/e2e/deepspeed_scripts/expected_deepspeed.json)
DEEPSPEED_VERSION = "0.19.8"


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
        spec = importlib.util.find_spec(TARGET)
        return Path(spec.origin).parent / path


class AliasDistributionFinder(importlib.abc.MetaPathFinder):
    """importlib.metadata's finder for the alias's `deepspeed` distribution; imports nothing (find_spec: None)."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        # a query for every distribution (name None) lists it too; names compare normalized, as PEP 503 does
        name = context.name
        if name is None or name.replace("_", "-").replace(".", "-").lower() == ALIAS:
            return iter([AliasDistribution()])
        return iter([])


class _AliasLoader(importlib.abc.Loader):
    """Loads `deepspeed` by installing the alias: the module it was given is then replaced in sys.modules by
    zerodp.deepspeed (the import system returns what sys.modules holds after exec_module)."""

    def create_module(self, spec):
        return None  # a plain module, discarded once the alias is in place

    def exec_module(self, module):
        from zerodp.deepspeed.alias import install  # torch and zerodp are imported here, at first use

        install()


class LazyAlias(importlib.abc.MetaPathFinder):
    """Answers `deepspeed` with a spec whose loading installs the alias; `deepspeed.*` submodules are then
    in sys.modules (the import system imports the parent first)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS:
            return None
        return importlib.machinery.ModuleSpec(ALIAS, _AliasLoader(), is_package=True)


def enabled() -> bool:
    """Whether the environment asks for the alias (ZERODP_DEEPSPEED_ALIAS=1)."""
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        sys.stderr.write(f"zerodp: {ENV}={value!r} is not understood; set {ENV}=1 to make `import deepspeed` "
                         f"zerodp.deepspeed, or unset it (0)\n")
    return value == "1"


def enable() -> None:
    """Put the alias's finders first on sys.meta_path (idempotent; imports nothing)."""
    for finder_type in (LazyAlias, AliasDistributionFinder):
        if not any(isinstance(finder, finder_type) for finder in sys.meta_path):
            sys.meta_path.insert(0, finder_type())


_started = []  # a venv whose lib64 links to lib runs each .pth file twice: check (and warn) once


def startup() -> None:
    """What the .pth file runs when the variable is set."""
    if not _started:
        _started.append(True)
        if enabled():
            enable()
