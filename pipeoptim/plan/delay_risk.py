"""The measured risk curve: extra samples to a target as a function of the uncorrected
distance e, per optimizer, fitted to the convergence study's points without assuming a form.

A straight line through the origin (``risk = κ·e``) cannot hold what the study measured on
its language models: one update of delay costs about as much as synchronous training, two
cost several times more, four or more never reach gpipe's loss in the run (the loss is
steeply convex in the delay, above all under AdamW). Fitted through every point at once, κ
is pulled down by the long delays (whose extra is capped at the run's length) and up by the
short ones, so it ranks a two-update delay cheaper than the study measured it.

The curve makes one assumption only: more uncorrected distance never costs fewer samples.
It is the least-squares **non-decreasing** fit of the points (pool adjacent violators),
anchored at (0, 0) (a synchronous method is the reference) and read between its knots by
linear interpolation. Past the last knot it holds the last value: the study's longest
delays never reached their target, so their extra is the run's length, a lower bound, and
the curve says no more than that. Points of about one e (within :data:`SPREAD`) are pooled
first. Points with e = 0 are left out (they measure the
reference's seed spread, not a delay); a point's negative extra (a method faster per sample
than synchronous) counts as 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pipeoptim.errors import PlanError

__all__ = [
    "MIN_POINTS",
    "SPREAD",
    "RiskCurve",
    "fit_risk_curve",
    "fit_risk_curves",
]

MIN_POINTS = 4
"""Measured points with e > 0 an optimizer needs for a curve of its own (fewer: the planner
keeps the linear κ of :mod:`pipeoptim.plan.risk`)."""


@dataclass(frozen=True)
class RiskCurve:
    """Extra samples to target as a non-decreasing, piecewise-linear function of e."""

    knots: tuple[tuple[float, float], ...]
    """(e, extra samples) in increasing e and non-decreasing extra, e > 0 and extra >= 0;
    the curve starts at (0, 0) before the first."""
    points: int = field(default=0, compare=False)
    """How many measured points (e > 0) the knots were fitted to (0: not recorded, as in a
curve read from ``risk_tables.json``); not part of the curve's identity."""

    def __post_init__(self) -> None:
        previous = (0.0, 0.0)
        for e, extra in self.knots:
            if not (math.isfinite(e) and math.isfinite(extra)) or e <= previous[0] or extra < 0:
                raise PlanError(
                    f"a risk curve's knots are (e, extra) with e increasing from > 0 and extra "
                    f">= 0 and non-decreasing; got {list(self.knots)}; refit it from the study "
                    "(`python examples/convergence/run.py --report-only`)"
                )
            if extra < previous[1]:
                raise PlanError(
                    f"a risk curve never falls: extra {extra} at e = {e} is below {previous[1]} "
                    f"at e = {previous[0]} (knots {list(self.knots)}); refit it from the study"
                )
            previous = (e, extra)
        if not self.knots:
            raise PlanError("a risk curve needs at least one knot (e > 0, extra)")

    def __call__(self, e: float) -> float:
        """Extra samples at uncorrected distance ``e`` (0 at e <= 0; the last knot's value
        past it)."""
        if e <= 0:
            return 0.0
        e0, y0 = 0.0, 0.0
        for e1, y1 in self.knots:
            if e <= e1:
                return y0 + (y1 - y0) * (e - e0) / (e1 - e0)
            e0, y0 = e1, y1
        return y0

    @property
    def last_e(self) -> float:
        """The largest e the curve was measured at; beyond it the curve holds its value."""
        return self.knots[-1][0]

    def to_json(self) -> list[list[float]]:
        return [[e, extra] for e, extra in self.knots]

    @classmethod
    def from_json(cls, value: object, where: str) -> RiskCurve:
        """A curve from ``[[e, extra], ...]`` (the form :meth:`to_json` writes)."""
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise PlanError(
                f"risk tables: {where} must be a list of [e, extra] pairs (got {value!r:.60})"
            )
        knots: list[tuple[float, float]] = []
        for pair in value:
            ok = (
                isinstance(pair, Sequence)
                and not isinstance(pair, str)
                and len(pair) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair)
            )
            if not ok:
                raise PlanError(
                    f"risk tables: {where} holds {pair!r}, not an [e, extra] pair of numbers; "
                    "regenerate it with `python examples/convergence/run.py --report-only`"
                )
            knots.append((float(pair[0]), float(pair[1])))
        return cls(tuple(knots))


SPREAD = 1.5
"""Points whose e lie within this factor of the smallest in their group are pooled before
the fit: e is known to about a third only (the same delay's closure differs between models
and depths), and without pooling the fit would order one delay's points by their closure
and draw a step through them that no delay has."""


def _pooled(points: Iterable[tuple[float, float]]) -> list[list[float]]:
    """Points with e > 0 in groups of :data:`SPREAD` (greedy, in increasing e): [mean e,
    mean extra, count] per group, in increasing e."""
    kept = sorted(
        (e, max(0.0, extra))
        for e, extra in points
        if e > 0 and math.isfinite(e) and math.isfinite(extra)
    )
    groups: list[list[tuple[float, float]]] = []
    for e, extra in kept:
        if groups and e <= groups[-1][0][0] * SPREAD:
            groups[-1].append((e, extra))
        else:
            groups.append([(e, extra)])
    return [
        [math.fsum(e for e, _ in g) / len(g), math.fsum(x for _, x in g) / len(g), len(g)]
        for g in groups
    ]


def fit_risk_curve(points: Iterable[tuple[float, float]]) -> RiskCurve | None:
    """The least-squares non-decreasing fit of ``(e, extra samples)`` points, as knots at
    each pooled block's mean e (None: fewer than :data:`MIN_POINTS` points with e > 0)."""
    pooled = _pooled(points)
    count = int(sum(w for _, _, w in pooled))
    if count < MIN_POINTS:
        return None
    # pool adjacent violators: blocks of [weighted sum of e, weighted sum of extra, weight]
    blocks: list[list[float]] = []
    for e, extra, w in pooled:
        blocks.append([e * w, extra * w, w])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
            last = blocks.pop()
            blocks[-1] = [a + b for a, b in zip(blocks[-1], last, strict=True)]
    knots = tuple((round(se / w, 6), round(sy / w, 4)) for se, sy, w in blocks)
    return RiskCurve(knots, points=count)


def fit_risk_curves(
    points: Iterable[tuple[str, float, float]],
) -> dict[str, RiskCurve]:
    """One curve per optimizer from ``(optimizer, e, extra samples)`` points, for the
    optimizers with enough of them."""
    by_optimizer: dict[str, list[tuple[float, float]]] = {}
    for optimizer, e, extra in points:
        by_optimizer.setdefault(optimizer, []).append((e, extra))
    curves = {o: fit_risk_curve(p) for o, p in sorted(by_optimizer.items())}
    return {o: c for o, c in curves.items() if c is not None}
