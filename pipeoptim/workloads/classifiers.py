"""The built-in classification models: flat lists of layers a pipeline can cut anywhere.

Each has at least 8 layers, enough for up to 8 stages:

* ``mlp``: a 9-layer perceptron on ``digits`` (64 features, 10 classes);
* ``cnn``: a 12-layer convolutional net on ``digits`` seen as 1x8x8 images;
* ``transformer``: a 10-layer transformer encoder on ``majority`` (15-bit strings).

Which data set each trains on is :data:`pipeoptim.workloads.loader.BUILTIN_MODELS`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["LearnedPositions", "MeanOverSequence", "cnn", "mlp", "transformer"]


class MeanOverSequence(nn.Module):
    """Averages a (batch, sequence, features) tensor over the sequence."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


class LearnedPositions(nn.Module):
    """Adds a learned position embedding to a (batch, sequence, features) tensor."""

    def __init__(self, length: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(length, dim) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight[: x.shape[1]]


def mlp() -> list[nn.Module]:
    return [
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    ]


def cnn() -> list[nn.Module]:
    return [
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    ]


def transformer(dim: int = 32, layers: int = 4) -> list[nn.Module]:
    blocks: list[nn.Module] = [
        nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        for _ in range(layers)
    ]
    return [
        nn.Embedding(2, dim),
        LearnedPositions(15, dim),
        *blocks,
        MeanOverSequence(),
        nn.Linear(dim, dim),
        nn.Tanh(),
        nn.Linear(dim, 2),
    ]
