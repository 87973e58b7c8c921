"""`deepspeed.runtime.dataloader.RepeatingLoader`: an iterator that restarts its loader when it ends."""

from __future__ import annotations


class RepeatingLoader:
    """Wrap an iterable (a DataLoader) so that `next()` never raises StopIteration: it starts it again."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            # a DistributedSampler reshuffles only if set_epoch is called: the next pass repeats the order
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
