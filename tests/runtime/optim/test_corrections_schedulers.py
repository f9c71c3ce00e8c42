"""Delay corrections under every scheduler (issue 33, items 3 and 4): a scheduler that cycles
the momentum must not erase the delay-dependent momentum, and PipeMare's prediction must use
the divided rates its update will use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import CyclicLR, LambdaLR, OneCycleLR

from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.corrections.delay_momentum import delay_momentum
from pipeoptim.runtime.pipeline import Pipeline

STAGES = 4
STEPS = 12


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator))
        for _ in range(STEPS)
    ]


def _pipeline(method: str, optimizer: OptimizerSpec, scheduler: Any) -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(
        nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(STAGES))),
        method=method,
        stages=STAGES,
        micro_batches=1,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=F.mse_loss,
        progress=False,
    )


def _one_cycle(opt: torch.optim.Optimizer) -> Any:
    return OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 4)


def _cyclic(opt: torch.optim.Optimizer) -> Any:
    return CyclicLR(opt, base_lr=0.01, max_lr=0.05, step_size_up=3)


SCHEDULERS: dict[str, tuple[Callable[[torch.optim.Optimizer], Any], OptimizerSpec, str]] = {
    "onecycle-adam": (_one_cycle, OptimizerSpec("adam", 0.01, {}), "betas"),
    "onecycle-sgd": (_one_cycle, OptimizerSpec("sgd", 0.01, {"momentum": 0.9}), "momentum"),
    "cyclic-sgd": (_cyclic, OptimizerSpec("sgd", 0.01, {"momentum": 0.9}), "momentum"),
}


def _momenta(pipe: Pipeline, key: str) -> list[list[float]]:
    """Per stage, the momentum each of its steps used (read in a step pre-hook)."""
    seen: list[list[float]] = [[] for _ in range(STAGES)]
    for k in range(STAGES):
        stage = pipe.stages[k]
        assert stage.optimizer is not None

        def pre(opt: torch.optim.Optimizer, *_: object, k: int = k) -> None:
            value = opt.param_groups[0][key]
            seen[k].append(float(value[0] if key == "betas" else value))

        stage.optimizer.register_step_pre_hook(pre)
    return seen


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_scheduler_cycling_momentum_keeps_the_delay_dependent_momentum(name: str) -> None:
    """Each step of stage k uses β_k = β + τ_k(0.99 − β)/P of the momentum β the scheduler
    set for it, and +nesterov trains differently from the plain method."""
    factory, spec, key = SCHEDULERS[name]
    plain, corrected = (
        _pipeline("pipeoptim", spec, factory),
        _pipeline("pipeoptim+nesterov", spec, factory),
    )
    scheduled, used = _momenta(plain, key), _momenta(corrected, key)
    plain.fit(_data(), epochs=1)
    corrected.fit(_data(), epochs=1)
    for k in range(STAGES):
        delay = STAGES - 1 - k
        expected = [delay_momentum(b, delay, STAGES) for b in scheduled[k]]
        assert len(used[k]) == STEPS
        assert used[k] == pytest.approx(expected, rel=1e-12), (k, used[k], scheduled[k])
    assert len(set(scheduled[0])) > 1  # the scheduler did cycle the momentum
    w_plain = plain.stages[0].module[0][0].weight
    w_corrected = corrected.stages[0].module[0][0].weight
    assert not torch.equal(w_plain, w_corrected)


def test_the_delay_dependent_momentum_is_set_once_under_a_scheduler_that_leaves_it() -> None:
    """A scheduler that never writes the momentum: the rule is applied once, not per step."""
    spec = OptimizerSpec("sgd", 0.01, {"momentum": 0.5})
    pipe = _pipeline("pipeoptim+nesterov", spec, lambda opt: LambdaLR(opt, lambda t: 1.0))
    used = _momenta(pipe, "momentum")
    pipe.fit(_data(), epochs=1)
    assert used[0] == pytest.approx([delay_momentum(0.5, 3, STAGES)] * STEPS, rel=1e-12)


def test_resume_under_a_cycling_scheduler_keeps_the_corrected_momentum() -> None:
    """The state dict carries what the correction set: a Pipeline loaded from it continues
    with the same momenta as the one that kept training."""
    factory, spec, key = SCHEDULERS["onecycle-sgd"]
    data = _data()
    whole = _pipeline("pipeoptim+nesterov", spec, factory)
    used_whole = _momenta(whole, key)
    whole.fit(data[:6], epochs=1)
    saved = whole.state_dict()
    whole.fit(data[6:], epochs=1)
    resumed = _pipeline("pipeoptim+nesterov", spec, factory)
    resumed.load_state_dict(saved)
    used_resumed = _momenta(resumed, key)
    resumed.fit(data[6:], epochs=1)
    assert used_resumed[0] == used_whole[0][6:]


def _recorded_rates(
    method: str, scheduler: Any
) -> tuple[list[float], list[tuple[int, list[float]]]]:
    """Stage 0's rate at each update, and per prediction (the updates made before it, the
    rates it summed over its next s updates)."""
    pipe = _pipeline(method, OptimizerSpec("sgd", 0.05, {"momentum": 0.0}), scheduler)
    stage = pipe.stages[0]
    assert stage.optimizer is not None and stage.predictor is not None
    applied: list[float] = []
    stage.optimizer.register_step_pre_hook(
        lambda opt, *_: applied.append(float(opt.param_groups[0]["lr"]))
    )
    predictions: list[tuple[int, list[float]]] = []
    predictor = stage.predictor
    original = predictor.predict_into

    def spy(dest: list[torch.Tensor], s: int, lrs: Any = None) -> None:
        # the rates the prediction sums: lrs, or the current rate s times (lr·s)
        current = float(stage.optimizer.param_groups[0]["lr"])  # type: ignore[union-attr]
        rows = [current] * s if lrs is None else list(lrs[0][:s])
        predictions.append((stage._updates_before_segment + stage.version, rows))
        original(dest, s, lrs)

    predictor.predict_into = spy  # type: ignore[method-assign]
    pipe.fit(_data(), epochs=1)
    return applied, predictions


@pytest.mark.parametrize(
    "scheduler",
    [None, lambda opt: LambdaLR(opt, lambda t: 1.0 / (1 + t))],
    ids=["constant", "lambda"],
)
def test_pipemare_predicts_with_the_rates_its_update_will_use(scheduler: Any) -> None:
    """pipeoptim+pipemare: every prediction sums the divided rates lr(t)/τ^p(t) of exactly
    the updates it looks ahead to, as they are applied (warm-up delays included)."""
    applied, predictions = _recorded_rates("pipeoptim+pipemare", scheduler)
    checked = 0
    for done, rates in predictions:
        ahead = applied[done : done + len(rates)]
        if len(ahead) < len(rates):
            continue  # looks past the run's last update
        assert rates == ahead, (done, rates, ahead)
        checked += 1
    assert checked >= STEPS - STAGES
    assert min(applied[3:]) < 0.05 / 1.5  # the rates were divided: the check is not vacuous
