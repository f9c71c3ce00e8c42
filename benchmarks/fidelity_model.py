"""The workload of ``bench_fidelity.py`` (and of ``bench_runtime.py``'s comparison): an MLP of
8 x (Linear(1024, 1024) + ReLU) and a Linear(1024, 10) head on random data, large enough that
compute, not Python, dominates each action. Use it as ``--model
benchmarks/fidelity_model.py:build``."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, DEPTH, CLASSES, SAMPLES = 1024, 8, 10, 4096


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
