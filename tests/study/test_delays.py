"""The delayed-gradient emulation against the pipeline it emulates."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import even_boundaries
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.study.delays import DelayEmulator, pipedream_delays


def _units() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(6)]


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def test_pipedreams_delays_give_the_pipelines_weights() -> None:
    """Four stages, 14 mini-batches, SGD-momentum and clipping: the emulation's weights are
    the pipedream pipeline's (two arithmetic paths of one rule: float32 tolerance)."""
    units = _units()
    twin = copy.deepcopy(units)
    pipe = Pipeline(
        units,
        method="pipedream",
        stages=4,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        loss_fn=F.mse_loss,
        grad_clip=0.5,
    )
    data = _data(14)
    pipe.fit(data, epochs=1)
    emulator = DelayEmulator(
        twin,
        even_boundaries(6, 4),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        loss_fn=F.mse_loss,
        delay=pipedream_delays(4),
        max_delay=3,
        grad_clip=0.5,
    )
    emulator.fit(data)
    trained = [p for u in units for p in u.parameters()]
    emulated = [p for u in twin for p in u.parameters()]
    for a, b in zip(trained, emulated, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_delay_is_plain_training_and_a_bad_rule_is_refused() -> None:
    units = _units()
    twin = copy.deepcopy(units)
    data = _data(5)
    emulator = DelayEmulator(
        units,
        [(0, 6)],
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        loss_fn=F.mse_loss,
        delay=lambda name, stage, step: 0,
        max_delay=0,
    )
    emulator.fit(data)
    model = nn.Sequential(*twin)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(nn.Sequential(*units).parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    bad = DelayEmulator(
        _units(),
        [(0, 6)],
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        loss_fn=F.mse_loss,
        delay=lambda name, stage, step: 2,
        max_delay=1,
    )
    with pytest.raises(RuntimeConfigError, match=r"τ=2 .*max_delay=1"):
        bad.step(*data[0])
