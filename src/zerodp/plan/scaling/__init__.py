"""The scale model: predicted step time, tokens/s and MFU of each ZeRO mode on a cluster, on paper.

Pure arithmetic, no torch.distributed: `workload` (the model and its FLOPs), `cluster` (devices and
link classes), `plan` (each mode's collectives by link class), `predictor` (the overlap rule and
the step time), `calibration` (this machine against zerodp's measured steps), `published` (the
papers' figures), `report` (tables for the CLI and docs/scaling.md).
"""

from .cluster import CLUSTERS, ClusterSpec
from .plan import MODES, Layout, Transfer, plan
from .predictor import Prediction, predict
from .workload import SHAPES, TransformerShape, Workload

__all__ = ["CLUSTERS", "ClusterSpec", "MODES", "Layout", "Transfer", "plan", "Prediction", "predict", "SHAPES",
           "TransformerShape", "Workload"]
