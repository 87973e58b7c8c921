"""Memory: the ZeRO paper's model-state formulas (`formulas.py`), what a rank actually holds (`report.py`),
and each rank's peak RSS predicted before launch (`peak_rss.py`, `model_shape.py`, `baseline.py`, `fit.py`).

`zerodp.memory` re-exports `formulas.py`, the estimator `zerodp estimate` prints.
"""

from .formulas import *  # noqa: F401,F403 (the estimator's API)
