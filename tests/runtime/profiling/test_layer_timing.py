"""Timing one optimizer step and one prediction for a layer's parameters."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch import nn

from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.profiling.layer_timing import time_step_and_prediction


def test_prediction_is_timed_into_buffers_of_each_parameters_own_shape() -> None:
    """Muon groups the matrices first, out of the module's order: the prediction must be
    written into buffers in the optimizer's group order, not resized into the wrong ones."""
    layer = nn.Linear(8, 4)  # module order: weight (4, 8), bias (4,)
    params = [layer.bias, layer.weight]  # a 1-D tensor first, so Muon's order differs
    before = [p.detach().clone() for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it resizes an out= tensor
        step_s, predict_s, state, setup = time_step_and_prediction(
            params, OptimizerSpec("muon", 1e-3), warmup=1, repeats=2, timer=_seconds
        )
    assert step_s > 0 and predict_s > 0 and state > 0 and setup is not None
    for p, w in zip(params, before, strict=True):
        assert torch.equal(p.detach(), w) and p.grad is None  # restored


def _seconds(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def test_a_kept_delta_is_timed_once_per_update_apart_from_the_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Muon: the first prediction after a step runs Newton–Schulz (the setup), the second
    only writes; a 'timer' counting Newton–Schulz calls makes the split exact. AdamW keeps
    nothing: no setup, every write alike."""
    from pipeoptim.runtime.optim.predictors import matrix

    calls: list[int] = []
    real = matrix._zeropower_via_newtonschulz

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(matrix, "_zeropower_via_newtonschulz", counted)

    def newton_schulz_calls(fn: object) -> float:
        before = len(calls)
        fn()  # type: ignore[operator]
        return float(len(calls) - before)

    layer = nn.Linear(8, 4)
    muon = time_step_and_prediction(
        list(layer.parameters()),
        OptimizerSpec("muon", 1e-3),
        warmup=1,
        repeats=3,
        timer=newton_schulz_calls,
    )
    # (the step runs torch's own Newton–Schulz, not the predictor's: not counted)
    assert (muon.step_s, muon.prediction_setup_s, muon.predict_s) == (0.0, 1.0, 0.0)
    adamw = time_step_and_prediction(
        list(layer.parameters()), OptimizerSpec("adamw", 1e-3), warmup=1, repeats=3, timer=_seconds
    )
    assert adamw.prediction_setup_s is None
