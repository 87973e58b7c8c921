"""A 2-rank stage-3 job that goes wrong on purpose (run under torchrun by test_divergence.py).

    stall   rank 1 sleeps before step 2's forward: rank 0's watchdog must report and exit
    extra   rank 1 runs one more block than rank 0, with debug_sync: both ranks name the block
    models  rank 1 builds a wider model: both ranks refuse to start
"""

import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import zerodp


class Net(nn.Module):
    def __init__(self, width: int, extra_on_rank: int = -1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.extra = nn.Linear(width, width)
        self.extra_on_rank = extra_on_rank

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        if torch.distributed.get_rank() == self.extra_on_rank:
            x = self.extra(x)
        return x


def main(mode: str) -> None:
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()  # ranks start in step, so a loaded machine's start-up skew is no "stall"
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    width = 16 + (8 if mode == "models" and rank == 1 else 0)
    model = Net(width, extra_on_rank=1 if mode == "extra" else -1)
    cfg = {"zero_optimization": {"stage": 3, "stage3_unit_min_params": 1, "stage3_param_persistence_threshold": 0,
                                 "debug_sync": mode == "extra"},
           "comm_timeout_s": 8}
    try:
        engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
        for step in range(4):
            if mode == "stall" and rank == 1 and step == 2:
                time.sleep(120)
            x = torch.randn(4, width)
            engine.backward(F.mse_loss(engine(x), x))
            engine.step()
    except (zerodp.ConfigError, zerodp.DivergenceError) as err:
        print(f"rank {rank} refused: {err}", file=sys.stderr, flush=True)
        sys.exit(4)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
