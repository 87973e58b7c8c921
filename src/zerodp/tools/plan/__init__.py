"""The planners: what a run would need and how fast it would go, on paper, before anything is launched.

Built on the runtime (it imports the runtime's arithmetic; the runtime never imports it:
tests/unit/test_layering.py). `zerodp estimate` prints these.

    formulas.py           the ZeRO paper's tables and limits: model-state bytes per stage, largest model
    activation_memory.py  ZeRO-R's activation bytes per micro-batch (checkpointing, Pa, cpu)
    peak_rss.py           each rank's peak RSS predicted term by term (docs/memory.md)
    peak_device.py        the same terms as peak device memory (less the host's)
    model_shape.py        a model and a run as the peak-RSS model's shapes
    baseline.py           the framework's own RSS on this machine, measured once and cached
    fit.py                what fits in a memory budget, per stage (`zerodp estimate --fit-memory`)
    offload_estimate.py   where an offloaded run's model states would live (`zerodp estimate --offload`)
    scaling/              the scale model: step time, tokens/s and MFU per ZeRO mode on a cluster (docs/scaling.md)

`zerodp.tools.plan` re-exports `formulas.py`, the estimator `zerodp estimate` prints.
"""

from .formulas import *  # noqa: F401,F403 (the estimator's API)
