"""A predictor that keeps Δ computes it in the update (``prepare_deltas``), not in the next
predicted forward: the same Δ bit for bit, the same Ŵ, no Newton–Schulz at the write."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.versions import passes, play
from torch import Tensor, nn
from torch.optim import Muon, Optimizer

from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.basis_rotation import BasisRotation
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW
from pipeoptim.runtime.optim.predict import WeightPredictor, predictor_for
from pipeoptim.runtime.optim.predictors import matrix
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.stage.stage import Stage

Factory = Callable[[list[nn.Parameter]], Optimizer]
FACTORIES: dict[str, Factory] = {
    "muon": lambda ps: Muon([p for p in ps if p.dim() == 2], lr=0.02, weight_decay=0.1),
    "basis-rotation": lambda ps: BasisRotation(ps, lr=1e-2, precondition_frequency=2),
    "muon+adamw": lambda ps: MuonWithAdamW(ps, lr=1e-2),
}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def train(model: nn.Module, opt: Optimizer, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(8, 6, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def pair(rule: str) -> tuple[nn.Module, WeightPredictor, nn.Module, WeightPredictor]:
    """Two equal models, optimizers and predictors: trained alike, predicted alike."""
    a = net()
    b = copy.deepcopy(a)
    opt_a = FACTORIES[rule](list(a.parameters()))
    opt_b = FACTORIES[rule](list(b.parameters()))
    return a, predictor_for(opt_a), b, predictor_for(opt_b)


def flat(deltas: list[list[Tensor | None]]) -> list[Tensor | None]:
    return [d for row in deltas for d in row]


@pytest.mark.parametrize("rule", sorted(FACTORIES))
def test_kept_delta_after_an_update_is_the_lazy_one_bitwise(rule: str) -> None:
    lazy_net, lazy, eager_net, eager = pair(rule)
    for _ in range(3):
        train(lazy_net, lazy.optimizer, 1)
        train(eager_net, eager.optimizer, 1)
        eager.prepare_deltas()
        assert eager.kept_computations >= 1
        got, want = flat(eager.delta()), flat(lazy.delta())
        assert [d is None for d in got] == [d is None for d in want]
        assert all(
            a is None or b is None or torch.equal(a, b) for a, b in zip(got, want, strict=True)
        )
        for s in (1, 2):
            for a, b in zip(eager.predicted(s), lazy.predicted(s), strict=True):
                assert torch.equal(a, b)
        assert len(eager.held_tensors()) == len(lazy.held_tensors())


@pytest.mark.parametrize("rule", ["muon", "muon+adamw"])
def test_a_prediction_after_prepare_runs_no_newton_schulz(
    rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, pred, _, _ = pair(rule)
    calls: list[int] = []
    real = matrix._zeropower_via_newtonschulz

    def counted(*args: Any) -> Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(matrix, "_zeropower_via_newtonschulz", counted)
    train(model, pred.optimizer, 2)
    pred.prepare_deltas()
    prepared = len(calls)
    assert prepared == 2  # one per matrix
    pred.predicted(1)
    pred.predicted(3)
    assert len(calls) == prepared


def test_prepare_before_any_step_keeps_nothing() -> None:
    _, pred, _, _ = pair("muon")
    pred.prepare_deltas()
    assert pred.held_tensors() == []


def test_a_predictor_without_step_hooks_prepares_nothing() -> None:
    model = net()
    opt = FACTORIES["muon"](list(model.parameters()))
    pred = matrix.MuonPredictor(opt, auto_hooks=False)  # nothing could drop what it keeps
    train(model, opt, 1)
    pred.prepare_deltas()
    assert pred.held_tensors() == [] and pred.kept_computations == 0


# -- the stage asks for it in its update --------------------------------------------------
ORDER = "0F0 0F1 0B0 0U0 0F2 0B1 0U1 0B2 0U2"


def test_the_stage_computes_delta_in_the_update_before_a_predicted_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """F2 runs after U0 and meets U1 before its backward: it predicts from the weights U0
    left, so U0 computes the Δ; U1 and U2 have no predicted forward after them."""
    torch.manual_seed(0)
    stage = Stage(
        1,
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        num_stages=3,
        method=get_method("pipeoptim"),
        options=StageOptions(OptimizerSpec("muon", 0.02, {})),
        micro_batches=1,
    )
    calls: list[str] = []
    real = matrix._zeropower_via_newtonschulz

    def counted(*args: Any) -> Tensor:
        calls.append(where)
        return real(*args)

    monkeypatch.setattr(matrix, "_zeropower_via_newtonschulz", counted)
    where = "begin"
    stage.begin_segment(passes("pipeoptim", ORDER))

    def at(action: str) -> None:
        nonlocal where
        where = action

    play(stage, ORDER, before=at)
    assert calls == ["0U0", "0U0"]  # two matrices, once, in the update F2 follows
