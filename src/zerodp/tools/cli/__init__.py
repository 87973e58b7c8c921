"""The `zerodp` command (`main.py`): train, estimate, consolidate. `python -m zerodp` runs it too.

Modules:
    estimate_rss.py   `zerodp estimate --peak-rss | --config FILE | --fit-memory BUDGET`: each rank's peak RSS ...
    launch_report.py  What the user sees when a rank of `zerodp train` fails: one line, with the long report in a ...
    main.py           The `zerodp` command: `train`, `estimate` and `consolidate`.
"""

from .main import TRAIN_OPTIONS, build_parser, main

__all__ = ["main", "build_parser", "TRAIN_OPTIONS"]
