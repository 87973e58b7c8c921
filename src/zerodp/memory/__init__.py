"""Memory: the ZeRO paper's model-state formulas (`model.py`) and what a rank actually holds (`report.py`).

`zerodp.memory` re-exports `model.py`, the estimator `zerodp estimate` prints.
"""

from .formulas import *  # noqa: F401,F403 (the estimator's API)
