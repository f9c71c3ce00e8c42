"""A small network and its synthetic data for runs over torch.distributed (gloo): the
ranks load this file by path (``path.py:net``), so the model costs no download. ``Trap``
kills its rank or turns the loss NaN where the environment asks (the failure tests)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.workloads.data import Dataset

HERE = Path(__file__)


class Trap(nn.Module):
    """Identity, except that in the rank named by $PIPEOPTIM_TEST_KILL_RANK it kills its own
    process (SIGKILL: no cleanup, no message) at the 6th training forward, or from
    $PIPEOPTIM_TEST_NAN_AT on returns NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return x
        self.calls += 1
        victim = os.environ.get("PIPEOPTIM_TEST_KILL_RANK")
        if victim is not None and victim == os.environ.get("RANK") and self.calls == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        nan_at = os.environ.get("PIPEOPTIM_TEST_NAN_AT")
        if nan_at is not None and self.calls >= int(nan_at):
            return x * float("nan")
        return x


def net() -> list[nn.Module]:
    return [
        nn.Linear(6, 16),
        nn.Tanh(),
        Trap(),
        nn.Linear(16, 16),
        nn.Dropout(0.1),
        Trap(),
        nn.Linear(16, 16),
        nn.Tanh(),
        Trap(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 3),
        Trap(),
    ]


def wide_net() -> list[nn.Module]:
    """Layers of 524,288 weights, which add their gradients inside their products
    (``accumulate_in_product.py``): on the stages that send a gradient, after it."""
    return [
        nn.Linear(6, 512),
        nn.Tanh(),
        nn.Linear(512, 1024),
        nn.Tanh(),
        nn.Linear(1024, 512),
        nn.Tanh(),
        nn.Linear(512, 1024),
        nn.Tanh(),
        nn.Linear(1024, 3),
    ]


def dataset() -> Dataset:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(140, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 3] > 0.5).long()
    return Dataset("toy", x[:120], y[:120], x[120:], y[120:], 3)


def config(
    method: str,
    stages: int,
    micro: int,
    transport: str,
    data_parallel: int = 1,
    model: str | None = None,
    **kw: object,
) -> TrainConfig:
    """A run of ``model`` (default: net and dataset of this file, which the ranks load)."""
    plan = Plan(
        method,
        stages,
        micro_batches=micro,
        data_parallel=data_parallel,
        optimizer=OptimizerSpec("adam", 0.01),
        model=model or f"{HERE}:net",
        batch_size=12,
    )
    return TrainConfig(plan, transport=transport, device="cpu", timeout=60, **kw)  # type: ignore[arg-type]
