"""How close a weight prediction lands to the weights it predicts, on a small regression."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeoptim.runtime.optim.predict import DisplacementPredictor, predictor_for


def distances(
    make: Callable[[list[Tensor]], Optimizer], warm: int = 20, span: int = 20, seed: int = 0
) -> list[tuple[float, float, float]]:
    """Mean over ``span`` prediction points of ‖Ŵ − W_{t+s}‖, ‖W_t − W_{t+s}‖ and the
    displacement rule's distance, for s = 1..4, on mini-batch linear regression."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, w_true = torch.randn(256, 8, generator=g), torch.randn(8, 4, generator=g)
    y = x @ w_true + 0.1 * torch.randn(256, 4, generator=g)
    order = torch.randperm(2048, generator=g) % 256
    lin = nn.Linear(8, 4, bias=False)
    opt = make([lin.weight])
    pred, disp = predictor_for(opt), DisplacementPredictor(opt)
    path: list[Tensor] = []
    ours: dict[tuple[int, int], Tensor] = {}
    theirs: dict[tuple[int, int], Tensor] = {}
    for t in range(warm + span + 4):
        idx = order[t * 32 : (t + 1) * 32]
        opt.zero_grad()
        ((lin(x[idx]) - y[idx]) ** 2).mean().backward()
        opt.step()
        path.append(lin.weight.detach().clone())
        if warm <= t < warm + span:
            for s in range(1, 5):
                ours[t, s], theirs[t, s] = pred.predicted(s)[0], disp.predicted(s)[0]
    points = range(warm, warm + span)
    return [
        (
            sum(float((ours[t, s] - path[t + s]).norm()) for t in points) / span,
            sum(float((path[t] - path[t + s]).norm()) for t in points) / span,
            sum(float((theirs[t, s] - path[t + s]).norm()) for t in points) / span,
        )
        for s in range(1, 5)
    ]
