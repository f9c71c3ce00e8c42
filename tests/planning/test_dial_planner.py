"""The planner and PipeOptim's dial: it tries M = 1, 2, 4 … P, each with the convergence
risk of the delay at that M, and picks M by effective throughput, throughput / (1 + κ·e)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import pipeoptim.plan.risk as risk_module
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.risk import schedule_versions
from pipeoptim.planning import (
    Candidate,
    evaluate_candidate,
    explain,
    micro_batch_options,
    plan_for,
    search,
)
from pipeoptim.planning.entry import PlanLimits

P = 4


def fixed_cost_profile(num_layers: int = 12) -> Profile:
    """Half of every pass is a fixed cost that does not shrink with the micro-batch, so
    whole mini-batches are much faster per sample than P micro-batches."""
    fwd = [0.01 * (1 + (i % 4)) for i in range(num_layers)]
    profile = Profile.from_costs(
        fwd,
        [2 * f for f in fwd],
        [1_000_000] * num_layers,
        [4_000_000] * num_layers,
        batch_size=32,
    )
    layers = tuple(
        replace(layer, forward_fixed_s=layer.forward_s / 2, backward_fixed_s=layer.backward_s / 2)
        for layer in profile.layers
    )
    return replace(profile, layers=layers)


def test_the_dial_offers_powers_of_two_up_to_p() -> None:
    assert micro_batch_options("pipeoptim", 8) == [1, 2, 4, 8]
    assert micro_batch_options("pipeoptim", 6) == [1, 2, 4, 6]
    assert micro_batch_options("pipeoptim", 8, batch_size=12) == [1, 2, 4]  # dividing it
    assert micro_batch_options("pipeoptim+nesterov", 4) == [1, 2, 4]
    assert micro_batch_options("pipeoptim+bounded", 4) == [1]
    assert micro_batch_options("xpipe", 4) == [4, 8, 16]  # the others are unchanged


def test_the_risk_is_computed_at_the_candidates_m() -> None:
    assert schedule_versions("pipeoptim", P)[0] == (3, 2, 1, 0)  # the default: M = 1
    assert schedule_versions("pipeoptim", P, 2)[0] == (2, 1, 1, 0)
    ranked = search(fixed_cost_profile(), P, methods=["pipeoptim"], optimizer="adamw")
    by_m = {c.micro_batches: c for c in ranked}
    assert sorted(by_m) == [1, 2, 4]
    for m, c in by_m.items():
        assert c.risk is not None and c.risk.distances == schedule_versions("pipeoptim", P, m)[0]
    e = [by_m[m].uncorrected for m in (1, 2, 4)]
    assert e[0] > e[1] > e[2] > 0  # a shorter delay, less uncorrected distance
    t = [by_m[m].throughput for m in (1, 2, 4)]
    assert t[0] > t[1] > t[2]  # smaller micro-batches, slower per sample here


def _kappa_range(by_m: dict[int, Candidate]) -> tuple[float, float]:
    """The κ for which M = 2 has the highest throughput / (1 + κ·e) of M = 1, 2, 4,
    solved from the candidates' own throughputs and uncorrected distances."""
    (t1, e1), (t2, e2), (t4, e4) = ((by_m[m].throughput, by_m[m].uncorrected) for m in (1, 2, 4))
    low = (t1 - t2) / (t2 * e1 - t1 * e2)  # above it M = 2 beats M = 1
    high = (t2 - t4) / (t4 * e2 - t2 * e4)  # below it M = 2 beats M = 4
    return low, high


def test_the_planner_picks_an_intermediate_m_by_time_to_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    profile = fixed_cost_profile()
    # a closure of the test's own (the study's tables change as it grows): one update is
    # predicted better than several, as the study measures
    monkeypatch.setitem(risk_module.CLOSURE, ("optimizer", "adamw"), {1: 0.6, 2: 0.4, 3: 0.2})
    # and the straight line κ·e, whose κ the test varies (no measured curve)
    monkeypatch.delitem(risk_module.RISK_CURVE, "adamw", raising=False)
    ranked = search(profile, P, methods=["pipeoptim"], optimizer="adamw")
    by_m = {c.micro_batches: c for c in ranked}
    low, high = _kappa_range(by_m)
    assert 0 < low < high
    limits = PlanLimits(optimizer="adamw")
    for kappa, want in ((low / 2, 1), ((low + high) / 2, 2), (2 * high, 4)):
        monkeypatch.setitem(risk_module.KAPPA, "adamw", kappa)
        choice = plan_for(profile, stages=P, method="pipeoptim", limits=limits)
        assert (choice.best.method, choice.best.micro_batches) == ("pipeoptim", want)
        assert choice.plan.micro_batches == want
    # the explanation says the chosen M, its delay at stage 0 and the counts it beat
    assert "M = 4 puts stage 0 1 update(s) behind" in choice.why
    assert "M = 1: 3 behind" in choice.why and "M = 2: 2 behind" in choice.why
    monkeypatch.setitem(risk_module.KAPPA, "adamw", (low + high) / 2)
    text = explain(search(profile, P, methods=["pipeoptim"], optimizer="adamw"))
    assert text.startswith("Run pipeoptim with 2 micro-batch(es)")
    assert "M = 2 puts stage 0 2 update(s) behind; chosen by effective samples/s" in text


def test_a_given_m_is_planned_as_given() -> None:
    choice = plan_for(
        fixed_cost_profile(), stages=P, method="pipeoptim", limits=PlanLimits(micro_batches=2)
    )
    assert choice.plan.micro_batches == 2 and len(choice.ranked) == 1


def test_the_memory_fit_works_at_every_m() -> None:
    """Stage k holds P-k micro-batches at every M, each of B/M samples: under a cap that
    whole mini-batches exceed, M = 1 is refitted and M = 2, 4 fit as they are."""
    profile = fixed_cost_profile()
    free = {m: evaluate_candidate(profile, P, "pipeoptim", m) for m in (1, 2, 4)}
    assert free[1].peak_memory_bytes > free[2].peak_memory_bytes > free[4].peak_memory_bytes
    cap = (free[1].peak_memory_bytes + free[2].peak_memory_bytes) // 2
    capped = {
        m: evaluate_candidate(profile, P, "pipeoptim", m, memory_cap_bytes=cap) for m in (1, 2, 4)
    }
    assert all(c.infeasible is None and c.peak_memory_bytes <= cap for c in capped.values())
    # whole mini-batches had to change to fit (another partition, or recomputation)
    one, before = capped[1], free[1]
    assert one.partition is not None and before.partition is not None
    assert one.fitted or one.partition.boundaries != before.partition.boundaries
    for m in (2, 4):  # the same plan as without a cap
        assert capped[m].peak_memory_bytes == free[m].peak_memory_bytes
