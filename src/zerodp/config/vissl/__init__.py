"""VISSL's config dialect, translated into zerodp's config: pure data, no torch, no optimizer, no engine.

    setup = zerodp.config.vissl.load_vissl("swav_8node_resnet.yaml")   # or a list: base, then overlays
    engine, schedule = zerodp.adapters.vissl.vissl_engine.initialize(setup, model, steps_per_epoch=len(loader))

    translate.py  reading VISSL's files (composition, hydra overrides), `load_vissl`, and the translation into
                  the DeepSpeed-style dict `config.load_config` reads (`is_vissl`, `translate_vissl`)
    resolve.py    user keys over VISSL's defaults -> a `VisslSetup`: stage, precision, clipping, auto LR scaling
    resolved.py   `VisslSetup` (the resolved result) and the key sets of the sections read
    defaults.py   VISSL's defaults.yaml values for the keys read
    lr_curve.py   VISSL's lr schedules as curves: the learning rate as a function of the fraction of training done

The dialect is an adapter above the runtime: `config` and `initialize` know nothing of VISSL. This package
is the pure translation (it imports nothing but `errors`); what needs a model or an optimizer (VISSL's param
groups, its SGD/Adam(W) with LARC, the lr scheduler that steps param groups) is
`integrations/vissl_optimizer.py`, beside the entry that builds an engine, `integrations/vissl.py`.
tests/unit/test_layering.py keeps this package torch-free and `errors`-only, and the runtime free of it.
"""

import sys as _sys

from .resolved import VisslSetup
from .translate import is_vissl, load_vissl, read_vissl, translate_vissl

# The former module path `zerodp.config_vissl` stays importable (code written before the layout change).
_sys.modules.setdefault("zerodp.config_vissl", _sys.modules[__name__])
setattr(_sys.modules["zerodp"], "config_vissl", _sys.modules[__name__])

__all__ = ["VisslSetup", "is_vissl", "load_vissl", "read_vissl", "translate_vissl"]
