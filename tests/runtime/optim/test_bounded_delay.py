"""Bounded delay by local gradient accumulation (``pipedream+bounded``, ``pipeoptim+bounded``).

Stage k accumulates its gradients over A_k = ⌈(P−1−k)/D⌉ mini-batches and updates once on
their mean, so a forward meets at most D = 1 update before its backward. These tests pin
the update against a literal reference of that rule, the scheduler's pace (once per
mini-batch), the delays a correction sees, and the rates a prediction reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.versions import passes, play
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.versions import analyze_order, steady_delays
from pipeoptim.runtime.optim.corrections import registry
from pipeoptim.runtime.optim.corrections.protocol import StageContext
from pipeoptim.runtime.optim.update import future_lrs
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.stage.stage import Stage


def first_of_three(method: str, lr: float = 0.1, **kw: Any) -> Stage:
    """Stage 0 of 3: τ_0 = 2, so under a bound of one update A_0 = 2."""
    torch.manual_seed(0)
    return Stage(
        0,
        nn.Sequential(nn.Linear(3, 2)),
        num_stages=3,
        method=get_method(method),
        options=StageOptions(OptimizerSpec("sgd", lr, {"momentum": 0.0}), **kw),
        micro_batches=1,
    )


# stage 0 of 3 under pipeoptim+bounded: two forwards ahead, an update every 2 backwards
ORDER = "0F0 0F1 0F2 0B0 0F3 0B1 0U1 0B2 0F4 0B3 0U3 0B4 0U4"


@pytest.mark.parametrize("method", ["pipedream+bounded", "pipeoptim+bounded"])
def test_an_update_applies_the_mean_gradient_of_its_mini_batches(method: str) -> None:
    """The literal rule with SGD: W ← W − lr·mean(g) over the mini-batches since the last
    update: (0, 1), (2, 3), and the last, partial window (4) alone, undivided."""
    stage = first_of_three(method)
    assert stage.accumulation == 2
    stage.begin_segment(passes(method, ORDER))
    xs = [torch.randn(4, 3) for _ in range(5)]
    gs = [torch.randn(4, 2) for _ in range(5)]
    params = list(stage.module.parameters())
    window: list[list[Tensor]] = []  # each backward's own gradient since the last update
    for action in ORDER.split():
        kind, mb = action[1], int(action[2:])
        if kind == "F":
            stage.forward(mb, xs[mb])
        elif kind == "B":
            before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
            stage.backward(mb, gs[mb])
            window.append([p.grad - b for p, b in zip(params, before, strict=True)])  # type: ignore[operator]
        else:
            w = [p.detach().clone() for p in params]
            stage.update()
            for i, p in enumerate(params):
                mean = sum(g[i] for g in window) / len(window)
                # float32: torch's SGD sums in another order than this reference
                torch.testing.assert_close(p.detach(), w[i] - 0.1 * mean, rtol=1e-6, atol=1e-6)
                assert p.grad is None  # zero_grad(set_to_none) after the step
            window = []
    assert stage.version == 3


def test_the_scheduler_steps_once_per_mini_batch_and_prediction_reads_rates_a_k_apart() -> None:
    """A rate halving each mini-batch: after the first update (2 mini-batches) it is
    lr/4, and the next two updates' rates are lr/4 and lr/16."""
    stage = first_of_three(
        "pipeoptim+bounded",
        lr=0.8,
        scheduler=lambda opt: LambdaLR(opt, lambda step: 0.5**step),
    )
    stage.begin_segment(passes("pipeoptim+bounded", ORDER))
    play(stage, " ".join(ORDER.split()[:7]))  # to the first update
    assert stage.optimizer is not None
    assert stage.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert stage.updater is not None
    lrs = stage.updater.future_lrs(2)
    assert lrs is not None and lrs[0] == pytest.approx([0.2, 0.05])


def test_future_lrs_every_steps_the_copy_that_many_times() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = LambdaLR(opt, lambda step: 1.0 / (1 + step))
    got = future_lrs(scheduler, opt, 3, every=3)
    assert got is not None and got[0] == pytest.approx([1.0, 1 / 4, 1 / 7])


class RecordDelays:
    """A correction that changes nothing and records the delay of every update."""

    def __init__(self) -> None:
        self.delays: list[int] = []

    def before_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        self.delays.append(delay)

    def after_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_correction_sees_delays_of_at_most_one_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four stages, six mini-batches: stage 0 updates after mini-batches 2 and 5, stage 1
    after 1, 3 and 5; the forwards of each window met at most one update (by hand from the
    schedule table in tests/plan/test_schedules.py)."""
    made: list[RecordDelays] = []

    def factory(context: StageContext, optimizer: Optimizer) -> RecordDelays:
        made.append(RecordDelays())
        return made[-1]

    monkeypatch.setitem(registry.CORRECTIONS, "record-delays", factory)
    method = replace(
        get_method("pipedream+bounded"),
        name="pipedream+bounded+rec",
        delay_correction="record-delays",
    )
    monkeypatch.setitem(METHODS, method.name, method)
    torch.manual_seed(0)
    pipe = Pipeline(
        nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))),
        method=method.name,
        stages=4,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        loss_fn=F.mse_loss,
        progress=False,
    )
    pipe.fit([(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(6)], epochs=1)
    assert [c.delays for c in made] == [[0, 1], [0, 1, 1], [0, 1, 1, 1, 1, 1], [0] * 6]


@pytest.mark.parametrize("p", [4, 8, 16])
def test_the_bound_holds_at_depth_and_the_stash_keeps_two_versions(p: int) -> None:
    for name in ("pipedream+bounded", "pipeoptim+bounded"):
        method = get_method(name)
        shape = method.shape(p, None, 3 * p)
        report = analyze_order(method.order_arrays(shape), method.weight_policy, 1)
        assert max(report.max_distance(k) for k in range(p)) == 1
        assert steady_delays(method, shape) == {k: int(k < p - 1) for k in range(p)}
        assert report.weight_copies == {k: 2 if k < p - 1 else 1 for k in range(p)}
