"""ZeRO-R's checkpoints on CUDA: exact against plain PyTorch with dropout from the CUDA generator and the
RNG tracker (which forks the CUDA generator here), and cpu_checkpointing's kept inputs leave the device
(pinned host copies on a side stream). Skipped where no GPU exists (`make test-gpu`)."""

import pytest
import torch

from zerodp.activations import DEVICE, HOST, Checkpointer, RNGStatesTracker
from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig as Settings
from tests.activation_regions import assert_same, region_input_bytes, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("form", ["checkpoint", "non_reentrant_checkpoint"])
@pytest.mark.parametrize("keys", [{}, {"cpu_checkpointing": True},
                                  {"cpu_checkpointing": True, "contiguous_memory_optimization": True}])
def test_exact_on_cuda(form, keys):
    torch.cuda.init()  # the snapshot keeps the CUDA generator's state once CUDA is initialized
    reference = train(None, None, device="cuda")
    checkpointer = Checkpointer(Settings(**keys), tracker=RNGStatesTracker("cuda"))
    assert_same(reference, train(checkpointer, form, device="cuda"))
    place = HOST if keys else DEVICE
    assert checkpointer.kept_bytes.peak[place] == region_input_bytes()


def test_cpu_checkpointing_frees_device_memory():
    layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(8)).cuda()
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    checkpoint_bytes = x.numel() * 4  # 16 MiB per block input

    def forward_holding(checkpointer):
        x.grad = None  # each run's gradient alone: the last one is compared with a plain backward below
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = x
        for layer in layers:
            h = checkpointer.checkpoint(layer, h)
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees side-stream-used blocks at its next allocation
        held = torch.cuda.memory_allocated() - before
        h.sum().backward()
        return held, checkpointer

    plain, _ = forward_holding(Checkpointer(Settings()))
    offloaded, checkpointer = forward_holding(Checkpointer(Settings(cpu_checkpointing=True)))
    # plain keeps the 7 intermediate block inputs on the device (x is the caller's), offload keeps none of them
    assert plain - offloaded >= 6 * checkpoint_bytes, (plain, offloaded)
    assert checkpointer.kept_bytes.peak[HOST] == 8 * checkpoint_bytes
    grads = x.grad.clone()
    x.grad = None
    h = x
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    torch.testing.assert_close(x.grad, grads, rtol=0, atol=0)
