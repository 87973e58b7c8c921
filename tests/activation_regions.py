"""A small model of checkpointed regions for the activation-checkpointing tests (unit and multi-rank).

Each region draws dropout from the default generator and, inside `tracker.fork()`, from the RNG
tracker (as a tensor-parallel region does), takes a keyword tensor (`scale`) and returns a tensor and
a non-tensor. `train(...)` runs plain PyTorch when `form` is None, else the region through the given
checkpointer form, and returns everything a test compares.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerodp.activations import Checkpointer, RNGStatesTracker

WIDTH, ROWS, LAYERS = 6, 5, 3


class Region(nn.Module):
    def __init__(self, tracker: RNGStatesTracker):
        super().__init__()
        self.tracker = tracker
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor):
        h = F.dropout(F.gelu(self.fc(x)), 0.3, training=True)       # default generator
        with self.tracker.fork():
            h = F.dropout(h, 0.2, training=True)                     # the tracker's state
        return x + self.proj(h) * scale, "not a tensor"


class Stack(nn.Module):
    def __init__(self, tracker: RNGStatesTracker, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.regions = nn.ModuleList(Region(tracker) for _ in range(LAYERS))
        self.scales = nn.Parameter(torch.linspace(0.5, 1.5, LAYERS))


def train(checkpointer: Checkpointer | None, form: str | None, steps: int = 2, seed: int = 3,
          model_seed: int = 0, tracker: RNGStatesTracker | None = None, device: str = "cpu") -> dict:
    """`steps` SGD steps; gradients of the last step, final parameters, and the input's gradient."""
    tracker = tracker if tracker is not None else (checkpointer.tracker if checkpointer else RNGStatesTracker(device))
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add("model-parallel-rng", seed + 1000)
    model = Stack(tracker, model_seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for step in range(steps):
        x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(step)).to(device).requires_grad_()
        h = x * 1.0  # a non-leaf input, as a block's residual stream is
        for i, region in enumerate(model.regions):
            scale = model.scales[i:i + 1]
            if form is None:
                h, tag = region(h, scale=scale)
            else:
                h, tag = getattr(checkpointer, form)(region, h, scale=scale)
            assert tag == "not a tensor"
        h.pow(2).sum().backward()
        out = {"grads": [p.grad.clone() for p in model.parameters()], "input_grad": x.grad.clone()}
        opt.step()
        opt.zero_grad()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["rng"] = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
    return out


def assert_same(a: dict, b: dict) -> None:
    # Exact: the recomputation repeats the forward's operations on the same values with the same masks.
    for x, y in zip(a["grads"] + a["params"] + [a["input_grad"]], b["grads"] + b["params"] + [b["input_grad"]]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert torch.equal(a["rng"], b["rng"]), "checkpointing changed the generator's final state"


def region_input_bytes(parts: int = 1) -> int:
    """Bytes one forward keeps: per region the input (ROWS x WIDTH fp32) and the scale (1 element),
    each as ceil(numel / parts) elements."""
    return LAYERS * (-(-ROWS * WIDTH // parts) + -(-1 // parts)) * 4
