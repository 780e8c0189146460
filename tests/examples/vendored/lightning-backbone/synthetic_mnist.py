"""Not upstream's: a stand-in for MNIST, written for tests/examples/test_lightning_backbone.py (see SOURCE.md).

``backbone_image_classifier.py`` downloads MNIST (``lightning.pytorch.demos.mnist_datamodule.MNIST``, which also
needs torchvision for its ``ToTensor``); nothing can be downloaded here, so the program imports this ``MNIST``
instead, called as it calls that one. It has MNIST's shape and sizes (60000 training images, 10000 test images,
each a 1x28x28 float tensor in [0, 1] with an ``int`` label 0-9; the program's ``random_split`` asks for exactly
55000 + 5000), and something to learn: each digit is a fixed random pattern, each image its digit's pattern plus
noise. The same on every rank and in every run (fixed seeds), computed once (1000 distinct images, 3 MB) and
repeated by index, so the full sizes cost nothing; nothing is written anywhere (``root`` and ``download`` are
ignored).
"""

import torch
from torch.utils.data import Dataset

DISTINCT = 1000


class MNIST(Dataset):
    def __init__(self, root=None, train: bool = True, download: bool = False, **kwargs) -> None:
        self.length = 60000 if train else 10000
        patterns = torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))  # one per digit
        generator = torch.Generator().manual_seed(1 if train else 2)
        self.labels = torch.randint(10, (DISTINCT,), generator=generator)
        noise = 0.5 * torch.randn(DISTINCT, 1, 28, 28, generator=generator)
        self.images = (patterns[self.labels] + noise).clamp(0, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index % DISTINCT], int(self.labels[index % DISTINCT])
