"""The scale model: predicted step time, tokens/s and MFU of each ZeRO mode on a cluster, on paper.

Pure arithmetic, no torch.distributed: `workload` (the model and its FLOPs), `cluster` (devices and
link classes), `plan` (each mode's collectives by link class), `predictor` (the overlap rule and
the step time), `calibration` (this machine against zerodp's measured steps), `published` (the
papers' figures), `report` (tables for the CLI and docs/scaling.md).

Modules:
    calibration.py  The calibration: the model on this machine's measured figures against zerodp's measured steps.
    cli.py          `zerodp estimate --cluster NAME ...`: the options and the command that prints the scale model's
    cluster.py      The cluster spec: devices, their FLOP rate and the two link classes, with the cost of one ...
    plan.py         The communication plan of one training step, per mode, by link class.
    predictor.py    The step-time predictor: compute + the communication the schedule cannot hide + the optimizer.
    published.py    Published throughput figures and the setups that reproduce them in the model, for ...
    report.py       Tables of predictions: the text `zerodp estimate --cluster` prints and the Markdown blocks of
    workload.py     The model workload of one training step: a transformer's shape, its parameter counts and its ...
"""

from .cluster import CLUSTERS, ClusterSpec
from .plan import MODES, Layout, Transfer, plan
from .predictor import Prediction, predict
from .workload import SHAPES, TransformerShape, Workload

__all__ = ["CLUSTERS", "ClusterSpec", "MODES", "Layout", "Transfer", "plan", "Prediction", "predict", "SHAPES",
           "TransformerShape", "Workload"]
