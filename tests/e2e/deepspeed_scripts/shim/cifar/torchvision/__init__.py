"""Test stand-in for torchvision (not installed here): a synthetic CIFAR10 and the three transforms the
fixture scripts use. Test input only: it lets byte-identical DeepSpeed scripts run without downloads."""

from . import datasets, transforms

__all__ = ["datasets", "transforms"]
