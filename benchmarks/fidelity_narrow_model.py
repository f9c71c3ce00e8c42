"""A narrow, deep MLP for ``bench_fidelity_set.py``: 16 x (Linear(128, 128) + ReLU) and a
Linear(128, 10) head on random data, so each action is small and the runtime's fixed costs
(messages, actions, waits) weigh as much as the layers. Use it as ``--model
benchmarks/fidelity_narrow_model.py:build``."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, DEPTH, CLASSES, SAMPLES = 128, 16, 10, 4096


def build() -> list[nn.Module]:
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return [*layers, nn.Linear(WIDTH, CLASSES)]


def dataset() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return x[:-512], y[:-512], x[-512:], y[-512:]
