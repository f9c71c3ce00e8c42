"""The measured risk curve: its fit (pooling, pool adjacent violators), its reading, its
checks and its place in the packaged tables and in ``method_risk``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan import risk
from pipeoptim.plan.delay_risk import (
    MIN_POINTS,
    SPREAD,
    RiskCurve,
    fit_risk_curve,
    fit_risk_curves,
)
from pipeoptim.plan.risk_tables import packaged_risk_tables, risk_tables_json
from pipeoptim.study.risk_fit import risk_tables_from_fit

RESULTS = Path(__file__).resolve().parents[2] / "examples" / "convergence" / "results"


def test_fit_pools_one_delay_and_never_falls() -> None:
    # three groups of e: {1, 1.2} (within SPREAD), {3}, {5}; the middle one falls below
    # the first, so the fit pools them into one level
    points = [(1.0, 0.2), (1.2, 0.4), (3.0, 0.1), (5.0, 2.0), (0.0, 0.5)]
    curve = fit_risk_curve(points)
    assert curve is not None
    # {1, 1.2, 3} pooled: mean e = 5.2 / 3, mean extra = 0.7 / 3
    assert curve.knots == ((round(5.2 / 3, 6), round(0.7 / 3, 4)), (5.0, 2.0))
    assert curve.points == 4  # the point at e = 0 is the reference's spread, left out


def test_negative_extra_counts_as_zero() -> None:
    curve = fit_risk_curve([(1.0, -0.5), (3.0, 0.3), (6.0, 0.6), (12.0, 0.9)])
    assert curve is not None and curve.knots[0] == (1.0, 0.0)


def test_too_few_points_give_no_curve() -> None:
    assert fit_risk_curve([(1.0, 0.1)] * (MIN_POINTS - 1)) is None
    assert fit_risk_curves([("adamw", 1.0, 0.1), ("muon", 1.0, 0.1)]) == {}


def test_groups_are_split_beyond_the_spread() -> None:
    e = 1.0
    curve = fit_risk_curve([(e, 0.1), (e * SPREAD * 1.01, 0.2), (4.0, 0.3), (9.0, 0.4)])
    assert curve is not None and len(curve.knots) == 4


def test_reading_interpolates_from_the_origin_and_holds_past_the_last_knot() -> None:
    curve = RiskCurve(((1.0, 0.2), (3.0, 1.0)))
    assert curve(0.0) == 0.0 and curve(-1.0) == 0.0
    assert curve(0.5) == pytest.approx(0.1)
    assert curve(2.0) == pytest.approx(0.6)
    assert curve(3.0) == pytest.approx(1.0)
    assert curve(30.0) == 1.0 and curve.last_e == 3.0


@pytest.mark.parametrize(
    "knots",
    [
        (),
        ((0.0, 0.1),),  # e must be > 0
        ((2.0, 0.1), (1.0, 0.2)),  # e must increase
        ((1.0, 0.5), (2.0, 0.2)),  # extra must not fall
        ((1.0, -0.1),),
    ],
)
def test_malformed_knots_are_refused_with_the_fix(knots: tuple[tuple[float, float], ...]) -> None:
    with pytest.raises(PlanError, match=r"knot|refit"):
        RiskCurve(knots)


def test_json_round_trip_and_refusal() -> None:
    curve = RiskCurve(((0.5, 0.1), (2.0, 0.7)))
    assert RiskCurve.from_json(curve.to_json(), "risk_curve['adamw']") == curve
    with pytest.raises(PlanError, match=r"\[e, extra\]"):
        RiskCurve.from_json([[1.0]], "risk_curve['adamw']")


def test_method_risk_reads_the_optimizer_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    curve = RiskCurve(((1.0, 0.3), (4.0, 3.0)))
    monkeypatch.setitem(risk.RISK_CURVE, "adamw", curve)
    # 2bw: one update stale on every stage but the last, e = 1
    r = risk.method_risk("2bw", "adamw", (1, 1, 0), (1, 1, 0))
    assert r.uncorrected == 1.0 and r.risk == pytest.approx(0.3) and r.curve is curve
    # pipedream at 4 stages: e = 3 on stage 0, two thirds of the way from 1 to 4
    r = risk.method_risk("pipedream", "adamw", (3, 2, 1, 0), (3, 2, 1, 0))
    assert r.risk == pytest.approx(0.3 + 2.7 * 2 / 3)
    # a κ given asks for the straight line
    r = risk.method_risk("pipedream", "adamw", (3, 2, 1, 0), (3, 2, 1, 0), kappa={"adamw": 0.1})
    assert r.risk == pytest.approx(0.3) and r.curve is None


def test_optimizer_without_curve_keeps_kappa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(risk.RISK_CURVE, "sgd", raising=False)
    monkeypatch.setitem(risk.KAPPA, "sgd", 0.25)
    r = risk.method_risk("2bw", "sgd", (1, 0), (1, 0))
    assert r.risk == pytest.approx(0.25) and r.curve is None


def test_packaged_curves_are_the_committed_study_fit() -> None:
    """The package's curves are what ``run.py --report-only`` fits from the committed
    study's points (rerun it after the study changes)."""
    fit = json.loads((RESULTS / "risk_fit.json").read_text())
    tables = risk_tables_from_fit(fit)
    assert tables.risk_curve == packaged_risk_tables().risk_curve
    refit = fit_risk_curves(
        (p["optimizer"], p["uncorrected"], p["extra_samples"]) for p in fit["points"]
    )
    assert refit == tables.risk_curve
    # and they are written back as read
    text = risk_tables_json(tables)
    assert json.loads(text)["risk_curve"] == {o: c.to_json() for o, c in refit.items()}


def test_the_curve_holds_the_measured_convexity_under_adamw() -> None:
    """What the curve exists for: on the study's language model one update of uncorrected
    distance under AdamW costs a fraction of what two or more cost, more than a straight
    line through the origin allows (read off the committed curve, so this fails if a refit
    loses the shape)."""
    curve = packaged_risk_tables().risk_curve["adamw"]
    one, three = curve(1.0), curve(3.0)
    assert 0 < one < three and three / one > 2.0


def test_a_correction_gain_holds_only_up_to_the_delay_it_was_measured_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A correction measured on a one-update delay (the extrapolation on xpipe) gives its
    gain to a stage one update behind, not to one seven behind."""
    monkeypatch.setitem(risk.CORRECTION_GAIN, "extrapolate/muon", 1.0)
    monkeypatch.setitem(risk.CORRECTION_GAIN_DELAY, "extrapolate/muon", 1)
    assert risk.correction_gain("extrapolate", "muon", delay=1) == 1.0
    assert risk.correction_gain("extrapolate", "muon", delay=7) == 0.0
    assert risk.correction_gain("extrapolate", "muon") == 1.0  # no delay asked: no bound
    near = risk.uncorrected_distance("pipeoptim+extrapolate", "muon", 1, 0)
    far = risk.uncorrected_distance("pipeoptim+extrapolate", "muon", 7, 0)
    assert near == 0.0 and far == risk.uncorrected_distance("pipeoptim", "muon", 7, 0) > 0


def test_gain_delays_are_the_longest_measured_per_correction() -> None:
    rows = [
        {"correction": "extrapolate", "optimizer": "muon", "delay": 1},
        {"correction": "delay-momentum", "optimizer": "muon", "delay": 7},
        {"correction": "delay-momentum", "optimizer": "muon", "delay": 15},
        {"correction": "qk-clip", "optimizer": "adamw"},  # written before delays: no bound
    ]
    assert risk.gain_delay_table(rows) == {"delay-momentum/muon": 15, "extrapolate/muon": 1}
