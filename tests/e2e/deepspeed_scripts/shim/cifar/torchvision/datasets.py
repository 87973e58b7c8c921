"""A synthetic CIFAR10: 64 train / 20 test images of 32x32x3 uint8 from a fixed seed; random train labels,
test labels cycling 0-9 (the CIFAR script divides by each class's test count)."""

import torch


class CIFAR10(torch.utils.data.Dataset):
    def __init__(self, root, train=True, download=False, transform=None):
        n, seed = (64, 1) if train else (20, 2)
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
        self.targets = torch.randint(0, 10, (n,), generator=g).tolist() if train else [i % 10 for i in range(n)]
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        image = self.data[i]
        return (self.transform(image) if self.transform else image), self.targets[i]
