"""A stage boundary whose shape depends on the data (a tensor whose per-sample shape changes,
a tuple that gains a tensor) is refused with the stage, the unit and both shapes, locally, in
evaluation and under dist, with the fix.

The dist runs import this file for their model (``path.py:trimming_net`` and ``dataset``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from pipeoptim import Pipeline
from pipeoptim.errors import PipeoptimError, StageError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.workloads.data import Dataset
from pipeoptim.workloads.train import train

HERE = Path(__file__)


class Trim(nn.Module):
    """Drops the trailing time steps that are padding (zero) in every sample of the batch: the
    boundary's shape depends on the data."""

    def forward(self, x: Tensor) -> Tensor:
        used = (x.abs().sum(dim=(0, 2)) > 0).nonzero()
        return x[:, : int(used.max()) + 1]


class Pool(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


class Grow(nn.Module):
    """Hands on a tuple that gains a tensor when the batch's first value is positive."""

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        h = torch.tanh(x)
        return (h, h * 2, h * 3) if bool(x[0, 0] > 0) else (h, h * 2)


class Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3)

    def forward(self, *parts: Tensor) -> Tensor:
        out: Tensor = self.head(sum(parts))  # type: ignore[arg-type]
        return out


def trimming_net() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Trim(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), Pool(), nn.Linear(8, 3)]


def dataset() -> Dataset:
    """Samples of 3 to 6 time steps, padded with zeros to 6."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(160, 6, 4, generator=g)
    lengths = torch.randint(3, 7, (160,), generator=g)
    x[torch.arange(6)[None, :] >= lengths[:, None]] = 0
    y = torch.randint(0, 3, (160,), generator=g)
    return Dataset("trim", x[:120], y[:120], x[120:], y[120:], 3)


def batches(steps: int) -> list[tuple[Tensor, Tensor]]:
    data = dataset()
    return [
        (data.train_x[i * 8 : i * 8 + 8], data.train_y[i * 8 : i * 8 + 8]) for i in range(steps)
    ]


SHAPE_REFUSAL = (
    r"stage 0, unit 2 \(Tanh\) hands the next stage a tensor of per-sample shape \(\d, 8\) "
    r"torch.float32 at micro-batch \d+, where the dry run gave \(\d, 8\) torch.float32"
)


def test_a_boundary_whose_shape_changes_is_refused_locally() -> None:
    pipe = Pipeline(trimming_net(), method="1f1b", stages=2, micro_batches=2, device="cpu")
    assert pipe.parts.bounds == [(0, 3), (3, 6)]
    with pytest.raises(StageError, match=SHAPE_REFUSAL) as err:
        pipe.fit(batches(8), max_steps=8)
    assert "pad every batch to one length" in str(err.value)


def test_evaluation_refuses_a_boundary_whose_shape_changes_too() -> None:
    pipe = Pipeline(trimming_net(), method="1f1b", stages=2, micro_batches=2, device="cpu")
    with pytest.raises(StageError, match=r"stage 0, unit 2 \(Tanh\) hands the next stage"):
        pipe.evaluate(batches(8))


def test_a_tuple_that_gains_a_tensor_is_refused() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    data = [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)
    ]
    data[0][0][0, 0] = -5.0  # the dry run (the first batch) sees two tensors
    data[1][0][0, 0] = 5.0  # the next batch's unit hands on three
    pipe = Pipeline([Grow(), Sum()], method="gpipe", stages=2, micro_batches=1, device="cpu")
    with pytest.raises(
        StageError,
        match=r"stage 0, unit 0 \(Grow\) hands the next stage a tuple of 3 tensors .* at "
        r"micro-batch 1, where the dry run gave a tuple of 2",
    ):
        pipe.fit(data, max_steps=4)


def config(**kw: object) -> TrainConfig:
    plan = Plan(
        "1f1b",
        2,
        micro_batches=2,
        optimizer=OptimizerSpec("adam", 0.01),
        model=f"{HERE}:trimming_net",
        batch_size=12,
    )
    return TrainConfig(plan, transport="dist", device="cpu", timeout=30, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_under_dist_the_same_refusal_names_stage_unit_and_shapes() -> None:
    with pytest.raises(PipeoptimError, match=SHAPE_REFUSAL):
        train(config(max_steps=8))
