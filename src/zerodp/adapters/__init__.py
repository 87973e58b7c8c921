"""Adapters: other projects' dialects spoken over the runtime. The runtime never imports them.

    deepspeed/   DeepSpeed's training API (`import zerodp.deepspeed as deepspeed`), its config keys, checkpoint
                 names, launcher and the `deepspeed` module alias; public name `zerodp.deepspeed`
    hf/          Hugging Face: `ZeroTrainer` (trainer.py) and the "auto" config values (auto_values.py)
    vissl/       a zerodp engine from a VISSL config file (vissl_engine.py, vissl_optimizer.py); VISSL's config
                 dialect itself is pure config: `zerodp.config.vissl`

`zerodp.deepspeed` is the DeepSpeed adapter's public name, from before the adapters had a folder of their own:
`_PublicName` below makes `zerodp.deepspeed[.X]` the very module objects of `zerodp.adapters.deepspeed[.X]`
(one module each, so classes and isinstance agree whichever name imported them).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

PUBLIC, REAL = "zerodp.deepspeed", "zerodp.adapters.deepspeed"


class _PublicSpec(importlib.machinery.ModuleSpec):
    """A public name's spec whose package is the real one: `python -m zerodp.deepspeed.run` executes run.py with
    `__package__` = zerodp.adapters.deepspeed, so its relative imports resolve as they do when imported."""

    @property
    def parent(self):
        real = REAL + self.name[len(PUBLIC):]
        return real if self.submodule_search_locations is not None else real.rpartition(".")[0]


class _PublicName(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`zerodp.deepspeed[.X]` -> `zerodp.adapters.deepspeed[.X]`, the same module object.

    The spec found carries this loader; `exec_module` replaces the placeholder module in sys.modules by the
    real one, and the import system returns what sys.modules holds then. It must come before the path
    finder: that one would load the real package's files a second time under the public name.
    `get_code` serves `python -m zerodp.deepspeed.run`, which runpy executes from the real file."""

    @staticmethod
    def _real(fullname: str) -> str:
        return REAL + fullname[len(PUBLIC):]

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PUBLIC and not fullname.startswith(PUBLIC + "."):
            return None
        real = importlib.util.find_spec(self._real(fullname))
        if real is None:
            return None
        return _PublicSpec(fullname, self, origin=real.origin, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module(self._real(module.__name__))

    def get_code(self, fullname):
        real = importlib.util.find_spec(self._real(fullname))
        return real.loader.get_code(real.name)


def install_public_name() -> None:
    """Put `_PublicName` first on sys.meta_path (once per process; `import zerodp` calls it)."""
    if not any(isinstance(f, _PublicName) for f in sys.meta_path):
        sys.meta_path.insert(0, _PublicName())
