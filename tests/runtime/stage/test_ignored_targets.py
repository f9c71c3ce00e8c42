"""Ignored targets (-100) across micro-batches (issue 33, items 10 and 13).

A micro-batch whose targets are all ignored has no token to average over: its loss is 0/0.
It contributes 0 to the loss and nothing to the gradient, so the batch trains as it does
with one micro-batch, instead of dying with "lower the learning rate". The mini-batch's loss
is its token mean (issue 63 item 3: each micro-batch weighed by its counted targets), so
gpipe's step is the full-batch step however the ignored targets are spread
(``test_token_mean_loss.py`` covers the schedules, padded sequences and dist)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.pipeline import Pipeline

IGNORE = -100


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def _pipeline(micro_batches: int) -> Pipeline:
    return Pipeline(
        _model(),
        method="gpipe",
        stages=2,
        micro_batches=micro_batches,
        optimizer=OptimizerSpec("sgd", 0.1, {"momentum": 0.0}),
        loss_fn=F.cross_entropy,
        progress=False,
    )


def _reference_step(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """One SGD step of one process on the whole batch's token mean."""
    model = _model()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None
            p -= 0.1 * p.grad
    return [p.detach() for p in model.parameters()]


def _weights(pipe: Pipeline) -> list[torch.Tensor]:
    return [p.detach() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()]


def _batch(targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(len(targets), 6, generator=torch.Generator().manual_seed(3))
    return x, torch.tensor(targets)


def test_a_micro_batch_of_ignored_targets_trains_and_contributes_nothing() -> None:
    x, y = _batch([IGNORE, IGNORE, 3, 1])
    pipe = _pipeline(2)
    result = pipe.fit([(x, y)], epochs=1)
    assert all(math.isfinite(loss) for loss in result.losses), result.losses
    expected = _reference_step(x, y)
    for got, want in zip(_weights(pipe), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    one = _pipeline(1)  # the same batch as one micro-batch trains too (the full-batch step)
    assert math.isfinite(one.fit([(x, y)], epochs=1).losses[0])


def test_evenly_spread_ignored_targets_give_the_full_batch_step() -> None:
    """Every micro-batch counts the same number of targets: gpipe with 2 micro-batches makes
    the full-batch step (token mean over the whole mini-batch)."""
    x, y = _batch([IGNORE, 2, 4, IGNORE])
    pipe = _pipeline(2)
    pipe.fit([(x, y)], epochs=1)
    full = _reference_step(x, y)
    for got, want in zip(_weights(pipe), full, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_evaluation_of_a_batch_of_ignored_targets_is_finite() -> None:
    pipe = _pipeline(2)
    x, y = _batch([IGNORE, IGNORE, IGNORE, IGNORE])
    xs, ys = _batch([0, 1, 2, 3])
    result = pipe.evaluate([(x, y), (xs, ys)])
    assert math.isfinite(result.loss), result


def test_evaluate_weights_by_tokens() -> None:
    """Two evaluation batches with ignored targets spread unevenly: the loss is the token
    mean over all of them (sum of token losses / non-ignored targets), as one forward of the
    whole set gives it."""
    pipe = _pipeline(2)
    x1, y1 = _batch([IGNORE, IGNORE, IGNORE, 1])
    x2, y2 = _batch([0, 1, 2, 3])
    result = pipe.evaluate([(x1, y1), (x2, y2)])
    model = _model()
    with torch.no_grad():
        logits = model(torch.cat([x1, x2]))
        expected = F.cross_entropy(logits, torch.cat([y1, y2]), reduction="sum") / 5
    assert result.loss == pytest.approx(float(expected), rel=1e-6)


def test_evaluate_without_ignored_targets_is_the_mean_over_samples() -> None:
    pipe = _pipeline(2)
    batches = [_batch([0, 1, 2, 3]), _batch([4, 0, 1])]
    result = pipe.evaluate(batches)
    model = _model()
    with torch.no_grad():
        losses = [F.cross_entropy(model(x), y) * len(y) for x, y in batches]
    assert result.loss == pytest.approx(float(sum(losses)) / 7, rel=1e-6)
