"""Prediction closure: the probe's arithmetic, and the direction of every predictor on a
tiny real run (predicted weights nearer the backward's weights than the stale ones)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeoptim.runtime.optim.prediction_closure import PredictionClosure
from pipeoptim.study.runs import RunSpec, run_one


def test_ratio_of_known_weights() -> None:
    probe = PredictionClosure()
    probe.forward(0, 5, 2, [torch.tensor([1.0, 1.0])], [torch.tensor([0.0, 0.0])])
    probe.backward(0, 5, [torch.tensor([2.0, 2.0])])
    probe.backward(0, 6, [torch.tensor([9.0, 9.0])])  # no predicted forward: ignored
    (sample,) = probe.samples
    assert sample.predicted_gap == pytest.approx(math.sqrt(2))
    assert sample.stale_gap == pytest.approx(math.sqrt(8))
    assert sample.ratio == pytest.approx(0.5)
    (stage,) = probe.summary()
    assert (stage.samples, stage.max_distance) == (1, 2)
    assert stage.closed == pytest.approx(0.5)


def test_unmoved_weights_are_left_out_of_the_summary() -> None:
    probe = PredictionClosure()
    probe.forward(1, 0, 1, [torch.ones(3)], [torch.zeros(3)])
    probe.backward(1, 0, [torch.zeros(3)])
    assert math.isnan(probe.samples[0].ratio)
    assert probe.summary() == []


@pytest.mark.parametrize(
    ("method", "optimizer", "lr", "most"),
    [
        ("pipeoptim", "adam", 1e-3, 0.8),
        ("pipeoptim", "sgd", 0.02, 0.8),
        ("spectrain", "sgd", 0.02, 0.8),
        ("xpipe", "adamw", 1e-3, 0.8),
    ],
)
def test_prediction_moves_toward_the_backward_weights(
    method: str, optimizer: str, lr: float, most: float
) -> None:
    """A predictor that returned W (Δ = 0) gives ratio 1, one with the sign flipped > 1."""
    record = run_one(
        RunSpec("mlp", method, optimizer, lr, 4, 0, steps=24, eval_every=24, closure=True)
    )
    assert record.diverged_at is None
    by_stage = {row["stage"]: row for row in record.closure}
    assert 0 in by_stage and by_stage[0]["max_distance"] == (1 if method == "xpipe" else 3)
    for row in by_stage.values():
        assert row["median_ratio"] < most, row
