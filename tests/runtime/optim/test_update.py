"""The stage's update and the slot a delay correction plugs into.

A correction is named by the method (``Method.delay_correction``) and built from
``corrections.registry.CORRECTIONS``; these tests register one of their own and check that
the stage calls it around every step with the delay the schedule's version analysis gives,
that what it does to the step takes effect, that its state is checkpointed, and that an
unknown name is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.versions import passes
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.corrections import registry
from pipeoptim.runtime.optim.corrections.protocol import StageContext
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.stage.stage import Stage


class DelayScaledLr:
    """lr / (1 + τ) for one step, then the rate is put back: a rule simple enough to check
    by hand. Records every call, and counts its steps in its state."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.steps = 0
        self._saved: list[float] = []

    def before_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        self.calls.append(("before", delay))
        self._saved = [float(g["lr"]) for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = float(g["lr"]) / (1 + delay)

    def after_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        self.calls.append(("after", delay))
        for g, lr in zip(optimizer.param_groups, self._saved, strict=True):
            g["lr"] = lr
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[DelayScaledLr]]:
    """Registers the correction ``delay-scaled-lr`` and, for pipedream and pipeoptim, a
    method ``<name>+dsl`` naming it; yields the corrections built, one per stage."""
    made: list[DelayScaledLr] = []

    def factory(context: StageContext, optimizer: Optimizer) -> DelayScaledLr:
        made.append(DelayScaledLr())
        return made[-1]

    monkeypatch.setitem(registry.CORRECTIONS, "delay-scaled-lr", factory)
    for name in ("pipedream", "pipeoptim"):
        method = replace(get_method(name), name=f"{name}+dsl", delay_correction="delay-scaled-lr")
        monkeypatch.setitem(METHODS, method.name, method)
    yield made


def stage_of(method: str, lr: float = 0.1) -> Stage:
    torch.manual_seed(0)
    return Stage(
        0,
        nn.Sequential(nn.Linear(3, 2)),
        num_stages=2,
        method=get_method(method),
        options=StageOptions(OptimizerSpec("sgd", lr, {"momentum": 0.0})),
        micro_batches=1,
    )


@pytest.mark.parametrize("method", ["pipedream+dsl", "pipeoptim+dsl"])
def test_the_correction_sees_each_update_with_its_delay_and_changes_the_step(
    built: list[DelayScaledLr], method: str
) -> None:
    """Two forwards in flight: the first update applies mini-batch 0 (τ = 0), the second
    mini-batch 1, whose forward ran one update earlier (τ = 1): SGD steps of lr and lr/2."""
    stage = stage_of(method)
    assert len(built) == 1
    stage.begin_segment(passes(method.split("+")[0], "0F0 0F1 0B0 0U0 0B1 0U1"))
    w = [p.detach().clone() for p in stage.module.parameters()]
    x0, x1, g0, g1 = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 2), torch.randn(4, 2)
    stage.forward(0, x0)
    stage.forward(1, x1)
    stage.backward(0, g0)
    grads0 = [p.grad.clone() for p in stage.module.parameters() if p.grad is not None]
    stage.update()
    stage.backward(1, g1)
    grads1 = [p.grad.clone() for p in stage.module.parameters() if p.grad is not None]
    stage.update()
    assert built[0].calls == [("before", 0), ("after", 0), ("before", 1), ("after", 1)]
    assert stage.optimizer is not None and stage.optimizer.param_groups[0]["lr"] == 0.1
    for p, w0, a, b in zip(stage.module.parameters(), w, grads0, grads1, strict=True):
        # torch's SGD and this sum round differently: float32 tolerance (a few ulps)
        torch.testing.assert_close(p.detach(), w0 - 0.1 * a - 0.05 * b, rtol=1e-6, atol=1e-6)


def test_the_delay_comes_from_the_schedule_of_every_stage(built: list[DelayScaledLr]) -> None:
    """Four stages of pipedream, six updates: stage k's τ grows by one per update in the
    warm-up up to its forwards in flight (3 - k), the last stage's is always 0."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    pipe = Pipeline(
        model,
        method="pipedream+dsl",
        stages=4,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        loss_fn=F.mse_loss,
        progress=False,
    )
    data = [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(6)]
    pipe.fit(data, epochs=1)
    befores = [[d for kind, d in c.calls if kind == "before"] for c in built]
    assert befores == [
        [0, 1, 2, 3, 3, 3],
        [0, 1, 2, 2, 2, 2],
        [0, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0],
    ]


def test_the_corrections_state_is_checkpointed(built: list[DelayScaledLr]) -> None:
    stage = stage_of("pipedream+dsl")
    stage.begin_segment(passes("pipedream", "0F0 0B0 0U0"))
    stage.forward(0, torch.randn(4, 3))
    stage.backward(0, torch.randn(4, 2))
    stage.update()
    state = stage.state_dict()
    assert state["correction"] == {"steps": 1}
    again = stage_of("pipedream+dsl")
    again.load_state_dict(state)
    assert built[1].steps == 1


def test_a_method_without_a_correction_checkpoints_none() -> None:
    assert stage_of("pipedream").state_dict()["correction"] is None


def test_an_unknown_correction_is_refused_with_the_known_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        registry.CORRECTIONS, "known-one", lambda context, optimizer: DelayScaledLr()
    )
    method = replace(get_method("pipedream"), name="pipedream+x", delay_correction="no-such")
    monkeypatch.setitem(METHODS, method.name, method)
    with pytest.raises(RuntimeConfigError, match=r"'no-such'.*known: .*known-one"):
        stage_of("pipedream+x")
