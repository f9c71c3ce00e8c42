"""Convergence risk: what a method's weight staleness costs in samples, from the study.

A schedule's version analysis says how far a forward's weights are from its backward's
(the prediction distance s) and how old an applied gradient is (the staleness). Neither is
what training pays: a predicting method with s = 7 reports staleness 0, yet its prediction
closes only part of the gap. The **uncorrected distance** e of a method on a stage puts
every method on one scale, in updates:

* flush (gpipe, 1f1b): e = 0, synchronous;
* stash (pipedream): e = s, the gradient is applied s updates after the weights it was
  computed on (forward and backward consistent);
* double buffer (2bw): e = its staleness (1);
* predict (pipeoptim, spectrain, xpipe): e = s · (1 − c), where c is the share of the stale
  distance ‖W_f − W_b‖ the prediction removes, measured per rule, optimizer and s by the
  convergence study (``examples/convergence``; :data:`CLOSURE`). c < 0 (a prediction that
  moves away) makes e larger than s.

The **convergence risk** is the extra samples a method needs to reach a target metric,
relative to a synchronous method: ``risk = κ_optimizer · e`` at the stage with the largest e
(stage 0 in an asynchronous 1F1B), κ fitted through the origin to the study's measured
samples-to-target (:data:`KAPPA`; ``risk_fit.json``). The planner ranks candidates by
``throughput / (1 + risk)``: samples per second that count toward accuracy.

The constants are from small models (digits MLP and CNN, a character GPT) and are a
first-order guide, not a guarantee; the study's command re-measures them on a user's model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pipeoptim.plan.methods import METHODS, Method, WeightPolicy, get_method
from pipeoptim.plan.versions import analyze_versions

__all__ = [
    "CLOSURE",
    "CORRECTION_GAIN",
    "DEPTH_COPIES",
    "DEPTH_EXCESS",
    "KAPPA",
    "MethodRisk",
    "RiskFitPoint",
    "closure",
    "closure_from_rows",
    "correction_gain",
    "depth_advice",
    "fit_risk",
    "gain_table",
    "join_row",
    "method_risk",
    "schedule_versions",
    "split_row",
    "uncorrected_distance",
]

CLOSURE: dict[tuple[str, str], dict[int, float]] = {
    ("optimizer", "adam"): {1: 0.69, 2: 0.6, 3: 0.57, 4: 0.48, 6: 0.38, 7: 0.38},
    ("optimizer", "adamw"): {
        1: 0.64,
        2: 0.62,
        3: 0.55,
        4: 0.51,
        5: 0.42,
        6: 0.36,
        7: 0.37,
        8: 0.43,
        9: 0.36,
        10: 0.34,
        11: 0.29,
        12: 0.28,
        13: 0.21,
        14: 0.18,
        15: 0.17,
        16: 0.24,
        17: 0.12,
        18: 0.24,
        19: 0.19,
        20: 0.17,
        21: 0.13,
        22: 0.11,
        23: 0.08,
        24: 0.07,
        25: -0.0,
        26: 0.04,
        27: 0.11,
        28: 0.0,
        29: 0.06,
        30: -0.04,
        31: -0.1,
    },
    ("optimizer", "basis-rotation"): {
        1: 0.77,
        2: 0.68,
        3: 0.64,
        4: 0.6,
        5: 0.56,
        6: 0.52,
        7: 0.49,
        8: 0.49,
        9: 0.47,
        10: 0.45,
        11: 0.42,
        12: 0.4,
        13: 0.37,
        14: 0.35,
        15: 0.32,
        16: 0.35,
        17: 0.32,
        18: 0.32,
        19: 0.3,
        20: 0.29,
        21: 0.27,
        22: 0.25,
        23: 0.23,
        24: 0.21,
        25: 0.18,
        26: 0.18,
        27: 0.17,
        28: 0.16,
        29: 0.16,
        30: 0.16,
        31: 0.14,
    },
    ("optimizer", "muon"): {
        1: 0.35,
        2: 0.44,
        3: 0.42,
        4: 0.43,
        5: 0.4,
        6: 0.37,
        7: 0.33,
        8: 0.42,
        9: 0.4,
        10: 0.37,
        11: 0.34,
        12: 0.32,
        13: 0.3,
        14: 0.27,
        15: 0.22,
        16: 0.37,
        17: 0.35,
        18: 0.33,
        19: 0.31,
        20: 0.28,
        21: 0.26,
        22: 0.24,
        23: 0.22,
        24: 0.21,
        25: 0.18,
        26: 0.17,
        27: 0.13,
        28: 0.13,
        29: 0.11,
        30: 0.1,
        31: 0.01,
    },
    ("optimizer", "nadam"): {1: 0.04, 2: 0.02, 3: -0.02, 4: -0.05, 5: -0.08, 6: -0.15, 7: -0.16},
    ("optimizer", "sgd"): {1: 0.75, 2: 0.67, 3: 0.58, 4: 0.59, 6: 0.57, 7: 0.51},
    ("shrunk", "adamw"): {
        1: 0.71,
        2: 0.65,
        3: 0.57,
        4: 0.58,
        5: 0.52,
        6: 0.47,
        7: 0.42,
        8: 0.45,
        9: 0.38,
        10: 0.36,
        11: 0.31,
        12: 0.29,
        13: 0.26,
        14: 0.18,
        15: 0.26,
    },
    ("shrunk", "muon"): {1: 0.37, 2: 0.4, 3: 0.39, 4: 0.37, 5: 0.35, 6: 0.33, 7: 0.29},
    ("spectrain", "adam"): {1: 0.0, 2: 0.0, 3: 0.01, 4: 0.0, 6: 0.0, 7: 0.01},
    ("spectrain", "adamw"): {
        1: 0.0,
        2: 0.0,
        3: 0.0,
        4: 0.0,
        5: 0.0,
        6: 0.0,
        7: 0.01,
        8: 0.0,
        9: 0.0,
        10: 0.0,
        11: 0.0,
        12: 0.0,
        13: 0.0,
        14: 0.0,
        15: 0.0,
    },
    ("spectrain", "sgd"): {1: 0.75, 2: 0.67, 3: 0.58, 4: 0.59, 6: 0.57, 7: 0.51},
    ("xpipe", "adam"): {1: 0.7},
    ("xpipe", "adamw"): {1: 0.57},
    ("xpipe", "sgd"): {1: 0.77},
}
"""(prediction rule, optimizer) -> {s: share of the stale distance removed}: per stage, the
median over its predicted forwards, averaged over the study's models and depths
(``examples/convergence/results/risk_fit.json``, ``closure_table``; a test keeps them equal).
Not monotone in s everywhere: stages with the same s sit at different depths and models."""

KAPPA: dict[str, float] = {
    "adam": 0.0476,
    "adamw": 0.3716,
    "basis-rotation": 0.1141,
    "muon": 0.1309,
    "nadam": 0.8649,
    "sgd": 0.3276,
}
"""Optimizer -> extra samples to target per update of uncorrected distance, fitted through
the origin over the digits MLP and CNN (3 seeds), the GPT (AdamW, 1 seed) and the language
model at depth (gpt-deep at 4, 8 and 16 stages: AdamW, and the NAdam and Muon rows against
gpipe under NAdam and Muon) at the rates the gpipe sweep chose (``risk_fit.json``,
``kappa``). A seed that never reached a fixed target counts as the whole run, so SGD's κ is
a lower bound where deep pipelines failed outright; gpt-deep's extra is read off gpipe's
curve (the samples gpipe needed for the loss the method ended with)."""

CORRECTION_GAIN: dict[str, float] = {
    "delay-momentum/basis-rotation": -0.08,
    "delay-momentum/muon": 0.18,
    "delay-momentum/nadam": 0.37,
    "pipemare-lr/adamw": 0.14,
    "qk-clip/adamw": 0.01,
    "qk-clip/muon": -0.19,
}
"""``correction/optimizer`` -> the share of its base method's excess final test loss over
gpipe's that the delay correction removed on the study's language model at depth
(``gpt-deep``; 1: all of it, 0: none, < 0: worse), the mean over the depths measured
(``risk_fit.json``, ``correction_gain``; a test keeps them equal). A corrected method's
uncorrected distance is its base's times ``1 − gain``; an unmeasured pair gains nothing,
so the planner ranks it level with its base, and the base, registered first, wins."""

DEFAULT_KAPPA = max(KAPPA[o] for o in ("sgd", "adam", "adamw"))
"""κ for an optimizer the study did not measure (RMSprop...): the largest of the three it
measured on every model (SGD, Adam, AdamW); NAdam's and Muon's come from a few rows of the
language model alone, too few to stand in for an unmeasured optimizer."""


def closure(rule: str, optimizer: str, s: int) -> float:
    """Share of the stale distance a prediction of ``rule`` removes at distance ``s``.

    Past the largest measured s the last measured value is used (closure falls with s, so
    this errs toward less risk at great depth: say so when s is far beyond the table);
    an unmeasured (rule, optimizer) closes nothing (c = 0).
    """
    table = CLOSURE.get((rule, optimizer))
    if not table or s <= 0:
        return 0.0
    if s in table:
        return table[s]
    below = [k for k in table if k < s]
    return table[max(below)] if below else table[min(table)]


def uncorrected_distance(
    method: str,
    optimizer: str,
    max_distance: int,
    max_staleness: int,
    closed: float | None = None,
    accumulation: int = 1,
) -> float:
    """e of ``method`` on a stage with prediction distance ``max_distance`` and staleness
    ``max_staleness`` (from ``versions.analyze_versions``), in mini-batches of gradient the
    forward's weights lack: under a bounded delay each update a forward misses carries the
    ``accumulation`` A_k mini-batches it applies, so one missed update is A_k of them (the
    information delay stays about τ_k mini-batches; what the bound saves is only what the
    prediction of that one update closes). ``closed`` overrides the measured closure of
    :data:`CLOSURE`."""
    spec = get_method(method)
    policy = spec.version_rule
    # per missed update: the share the correction keeps, of the A_k mini-batches it carries
    kept = (1.0 - correction_gain(spec.correction, optimizer)) * accumulation
    if policy is WeightPolicy.FLUSH:
        return 0.0
    if policy is WeightPolicy.STASH:
        return max(0.0, kept * max(max_distance, max_staleness))
    if policy is WeightPolicy.DOUBLE_BUFFER:
        return max(0.0, kept * max_staleness)
    c = (
        closed
        if closed is not None
        else closure(spec.predictor or "optimizer", optimizer, max_distance)
    )
    return max(0.0, kept * max_distance * (1.0 - c))


@dataclass(frozen=True)
class MethodRisk:
    """The convergence-risk reading of one candidate."""

    distances: tuple[int, ...]
    """Prediction distance s per stage (its largest over the run)."""
    staleness: tuple[int, ...]
    """Version staleness of the applied gradients per stage."""
    uncorrected: float
    """e at the stage where it is largest."""
    closed: float | None
    """Share of the stale distance the prediction removes at that stage (predicting methods)."""
    risk: float
    """Predicted extra samples to a target, relative to a synchronous method."""
    kappa: float


def method_risk(
    method: str,
    optimizer: str,
    distances: Iterable[int],
    staleness: Iterable[int],
    kappa: Mapping[str, float] | None = None,
) -> MethodRisk:
    """Risk of ``method`` from the per-stage distances and staleness of its schedule."""
    ds, st = tuple(distances), tuple(staleness)
    spec = get_method(method)
    rule = spec.predictor or "optimizer"
    p = len(ds)
    es = [
        uncorrected_distance(method, optimizer, s, old, accumulation=spec.accumulation(k, p))
        for k, (s, old) in enumerate(zip(ds, st, strict=True))
    ]
    worst = max(range(len(es)), key=lambda k: es[k], default=0)
    e = es[worst] if es else 0.0
    closed = closure(rule, optimizer, ds[worst]) if spec.predicts and ds else None
    k = (kappa or KAPPA).get(optimizer, DEFAULT_KAPPA)
    return MethodRisk(ds, st, e, closed, k * e, k)


def schedule_versions(
    method: str, num_stages: int, micro_batches: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage, the largest prediction distance s and staleness of ``method``'s schedule
    (a run long enough to reach the steady state)."""
    spec = get_method(method)
    m = spec.micro_batches_for(micro_batches or num_stages)
    shape = spec.shape(num_stages, m, 2 * num_stages + 2)
    report = analyze_versions(spec.schedule(shape), spec.version_rule, shape.micro_batches)
    stages = range(num_stages * shape.virtual_stages)
    return (
        tuple(report.max_distance(k) for k in stages),
        tuple(report.max_staleness(k) for k in stages),
    )


@dataclass(frozen=True)
class RiskFitPoint:
    """One measured (method, optimizer, depth) of the study."""

    model: str
    method: str
    optimizer: str
    stages: int
    uncorrected: float
    extra_samples: float
    """Samples to target over gpipe's, minus 1 (0: as fast per sample as synchronous)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def closure_from_rows(
    rows: Iterable[Mapping[str, Any]],
) -> dict[tuple[str, str], dict[int, float]]:
    """The :data:`CLOSURE` table from the study's closure rows (``risk_fit.json``): per
    (rule, optimizer, s), the mean over models and depths of the per-stage closure, rounded
    to two decimals."""
    sums: dict[tuple[str, str, int], list[float]] = {}
    for row in rows:
        name = str(row.get("rule_of", row["method"]))
        if name not in METHODS or METHODS[name].correction is not None:
            continue  # a study variant or a corrected method: not the plain rule's closure
        rule = get_method(name).predictor or "optimizer"
        key = (rule, str(row["optimizer"]), int(row["s"]))
        sums.setdefault(key, []).append(float(row["closed"]))
    table: dict[tuple[str, str], dict[int, float]] = {}
    for (rule, opt, s), values in sorted(sums.items()):
        table.setdefault((rule, opt), {})[s] = round(sum(values) / len(values), 2)
    return table


def gain_table(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """:data:`CORRECTION_GAIN` from the study's rows (``risk_fit.json``,
    ``correction_gains``): per ``correction/optimizer``, the mean gain over the depths
    measured, rounded to two decimals."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        sums.setdefault(f"{row['correction']}/{row['optimizer']}", []).append(float(row["gain"]))
    return {key: round(sum(v) / len(v), 2) for key, v in sorted(sums.items())}


def correction_gain(correction: str | None, optimizer: str) -> float:
    """The measured gain of ``correction`` under ``optimizer`` (0 where unmeasured)."""
    if correction is None:
        return 0.0
    return CORRECTION_GAIN.get(f"{correction}/{optimizer}", 0.0)


def fit_risk(points: Iterable[RiskFitPoint]) -> dict[str, tuple[float, int]]:
    """κ per optimizer by least squares through the origin (extra = κ·e), clamped at 0;
    returns {optimizer: (κ, number of points with e > 0)}."""
    sums: dict[str, list[float]] = {}
    for p in points:
        if p.uncorrected <= 0 or not math.isfinite(p.extra_samples):
            continue
        acc = sums.setdefault(p.optimizer, [0.0, 0.0, 0.0])
        acc[0] += p.uncorrected * p.extra_samples
        acc[1] += p.uncorrected**2
        acc[2] += 1
    return {opt: (max(0.0, xy / xx), int(n)) for opt, (xy, xx, n) in sums.items()}


DEPTH_EXCESS: dict[int, dict[str, float]] = {
    4: {
        "gpipe": 0.0,
        "2bw": 0.0832,
        "xpipe": 0.0141,
        "pipedream": 0.4028,
        "spectrain": 0.4081,
        "pipeoptim": 0.3244,
        "pipedream+pipemare": 0.2629,
        "pipeoptim+pipemare": 0.1599,
        "pipeoptim+shrink": 0.3138,
        "pipedream+bounded": 0.2202,
        "pipeoptim+bounded": 0.1549,
        "pipeoptim+qk-clip": 0.3173,
        "gpipe (nadam)": 0.0,
        "pipedream+nesterov (nadam)": 0.0649,
        "pipeoptim (muon)": 0.0157,
        "gpipe (muon)": 0.0,
        "pipeoptim+nesterov (muon)": 0.0119,
        "pipeoptim+bounded (muon)": 0.0447,
        "gpipe (basis-rotation)": 0.0,
        "pipeoptim (basis-rotation)": 0.0135,
        "pipeoptim+nesterov (basis-rotation)": 0.0245,
    },
    8: {
        "gpipe": 0.0,
        "2bw": 0.075,
        "xpipe": 0.0063,
        "pipedream": 0.5104,
        "spectrain": 0.52,
        "pipeoptim": 0.517,
        "pipedream+pipemare": 0.5508,
        "pipeoptim+pipemare": 0.4903,
        "pipeoptim+shrink": 0.4975,
        "pipedream+bounded": 0.3766,
        "pipeoptim+bounded": 0.3143,
        "pipeoptim+qk-clip": 0.4888,
        "gpipe (nadam)": 0.0,
        "pipeoptim (nadam)": 0.5347,
        "pipedream+nesterov (nadam)": 0.4044,
        "pipeoptim+nesterov (nadam)": 0.4421,
        "pipeoptim (muon)": 0.0857,
        "gpipe (muon)": 0.0,
        "pipedream (muon)": 0.1407,
        "pipeoptim+shrink (muon)": 0.0894,
        "pipeoptim+nesterov (muon)": 0.0586,
        "pipeoptim+bounded (muon)": 0.1425,
        "gpipe (basis-rotation)": 0.0,
        "pipeoptim (basis-rotation)": 0.0529,
        "pipeoptim+qk-clip (muon)": 0.1024,
        "pipeoptim+nesterov (basis-rotation)": 0.0365,
    },
    16: {
        "gpipe": 0.0,
        "2bw": 0.0909,
        "xpipe": 0.0101,
        "pipedream": 0.6576,
        "spectrain": 0.553,
        "pipeoptim": 0.5585,
        "pipedream+pipemare": 0.5929,
        "pipeoptim+pipemare": 0.5895,
        "pipeoptim+shrink": 0.5818,
        "pipedream+bounded": 0.4533,
        "pipeoptim+bounded": 0.4873,
        "pipeoptim+qk-clip": 0.585,
        "gpipe (nadam)": 0.0,
        "pipedream+nesterov (nadam)": 0.5482,
        "pipeoptim (muon)": 0.2277,
        "gpipe (muon)": 0.0,
        "pipeoptim+nesterov (muon)": 0.1665,
        "pipeoptim+bounded (muon)": 0.3617,
        "gpipe (basis-rotation)": 0.0,
        "pipeoptim (basis-rotation)": 0.1157,
        "pipeoptim+nesterov (basis-rotation)": 0.0851,
    },
    32: {
        "gpipe": 0.0,
        "xpipe": 0.0602,
        "pipeoptim": 0.5575,
        "gpipe (muon)": 0.0,
        "pipeoptim (muon)": 0.4919,
        "pipeoptim+nesterov (muon)": 0.4679,
        "gpipe (basis-rotation)": 0.0,
        "pipeoptim (basis-rotation)": 0.4533,
    },
}
"""Stages -> row of the study's language-model table (a method, ``method (optimizer)`` for
another optimizer) -> its final test loss over gpipe's **under the same optimizer** at that
depth, minus 1 (``gpipe (muon)`` for a Muon row; ``gpt-deep``, AdamW's rate and recipe;
``risk_fit.json``, ``depth_excess``; a test keeps them equal)."""

DEPTH_COPIES: dict[int, dict[str, int]] = {
    4: {
        "gpipe": 1,
        "2bw": 2,
        "xpipe": 2,
        "pipedream": 4,
        "spectrain": 2,
        "pipeoptim": 2,
        "pipedream+pipemare": 4,
        "pipeoptim+pipemare": 2,
        "pipeoptim+shrink": 2,
        "pipedream+bounded": 2,
        "pipeoptim+bounded": 2,
        "pipeoptim+qk-clip": 2,
        "gpipe (nadam)": 1,
        "pipedream+nesterov (nadam)": 4,
        "pipeoptim (muon)": 2,
        "gpipe (muon)": 1,
        "pipeoptim+nesterov (muon)": 2,
        "pipeoptim+bounded (muon)": 2,
        "gpipe (basis-rotation)": 1,
        "pipeoptim (basis-rotation)": 2,
        "pipeoptim+nesterov (basis-rotation)": 2,
    },
    8: {
        "gpipe": 1,
        "2bw": 2,
        "xpipe": 2,
        "pipedream": 8,
        "spectrain": 2,
        "pipeoptim": 2,
        "pipedream+pipemare": 8,
        "pipeoptim+pipemare": 2,
        "pipeoptim+shrink": 2,
        "pipedream+bounded": 2,
        "pipeoptim+bounded": 2,
        "pipeoptim+qk-clip": 2,
        "gpipe (nadam)": 1,
        "pipeoptim (nadam)": 2,
        "pipedream+nesterov (nadam)": 8,
        "pipeoptim+nesterov (nadam)": 2,
        "pipeoptim (muon)": 2,
        "gpipe (muon)": 1,
        "pipedream (muon)": 8,
        "pipeoptim+shrink (muon)": 2,
        "pipeoptim+nesterov (muon)": 2,
        "pipeoptim+bounded (muon)": 2,
        "gpipe (basis-rotation)": 1,
        "pipeoptim (basis-rotation)": 2,
        "pipeoptim+qk-clip (muon)": 2,
        "pipeoptim+nesterov (basis-rotation)": 2,
    },
    16: {
        "gpipe": 1,
        "2bw": 2,
        "xpipe": 2,
        "pipedream": 16,
        "spectrain": 2,
        "pipeoptim": 2,
        "pipedream+pipemare": 16,
        "pipeoptim+pipemare": 2,
        "pipeoptim+shrink": 2,
        "pipedream+bounded": 2,
        "pipeoptim+bounded": 2,
        "pipeoptim+qk-clip": 2,
        "gpipe (nadam)": 1,
        "pipedream+nesterov (nadam)": 16,
        "pipeoptim (muon)": 2,
        "gpipe (muon)": 1,
        "pipeoptim+nesterov (muon)": 2,
        "pipeoptim+bounded (muon)": 2,
        "gpipe (basis-rotation)": 1,
        "pipeoptim (basis-rotation)": 2,
        "pipeoptim+nesterov (basis-rotation)": 2,
    },
    32: {
        "gpipe": 1,
        "xpipe": 2,
        "pipeoptim": 2,
        "gpipe (muon)": 1,
        "pipeoptim (muon)": 2,
        "pipeoptim+nesterov (muon)": 2,
        "gpipe (basis-rotation)": 1,
        "pipeoptim (basis-rotation)": 2,
    },
}
"""The weight copies each row of :data:`DEPTH_EXCESS` keeps on its fullest stage."""

DEPTH_EXCESS_FIRST: dict[int, dict[str, float]] = {
    4: {
        "gpipe": 0.0,
        "2bw": 0.0832,
        "xpipe": 0.0141,
        "pipedream": 0.4028,
        "spectrain": 0.4081,
        "pipeoptim": 0.3244,
        "pipedream+pipemare": 0.2629,
        "pipeoptim+pipemare": 0.1599,
        "pipeoptim+shrink": 0.3138,
        "pipedream+bounded": 0.2202,
        "pipeoptim+bounded": 0.1549,
        "pipeoptim+qk-clip": 0.3173,
        "gpipe (nadam)": -0.0143,
        "pipedream+nesterov (nadam)": 0.0496,
        "pipeoptim (muon)": -0.0727,
        "gpipe (muon)": -0.087,
        "pipeoptim+nesterov (muon)": -0.0761,
        "pipeoptim+bounded (muon)": -0.0462,
        "gpipe (basis-rotation)": -0.1167,
        "pipeoptim (basis-rotation)": -0.1047,
        "pipeoptim+nesterov (basis-rotation)": -0.095,
    },
    8: {
        "gpipe": 0.0,
        "2bw": 0.075,
        "xpipe": 0.0063,
        "pipedream": 0.5104,
        "spectrain": 0.52,
        "pipeoptim": 0.517,
        "pipedream+pipemare": 0.5508,
        "pipeoptim+pipemare": 0.4903,
        "pipeoptim+shrink": 0.4975,
        "pipedream+bounded": 0.3766,
        "pipeoptim+bounded": 0.3143,
        "pipeoptim+qk-clip": 0.4888,
        "gpipe (nadam)": -0.0167,
        "pipeoptim (nadam)": 0.509,
        "pipedream+nesterov (nadam)": 0.3809,
        "pipeoptim+nesterov (nadam)": 0.418,
        "pipeoptim (muon)": -0.0116,
        "gpipe (muon)": -0.0896,
        "pipedream (muon)": 0.0385,
        "pipeoptim+shrink (muon)": -0.0082,
        "pipeoptim+nesterov (muon)": -0.0362,
        "pipeoptim+bounded (muon)": 0.0401,
        "gpipe (basis-rotation)": -0.1158,
        "pipeoptim (basis-rotation)": -0.069,
        "pipeoptim+qk-clip (muon)": 0.0036,
        "pipeoptim+nesterov (basis-rotation)": -0.0835,
    },
    16: {
        "gpipe": 0.0,
        "2bw": 0.0909,
        "xpipe": 0.0101,
        "pipedream": 0.6576,
        "spectrain": 0.553,
        "pipeoptim": 0.5585,
        "pipedream+pipemare": 0.5929,
        "pipeoptim+pipemare": 0.5895,
        "pipeoptim+shrink": 0.5818,
        "pipedream+bounded": 0.4533,
        "pipeoptim+bounded": 0.4873,
        "pipeoptim+qk-clip": 0.585,
        "gpipe (nadam)": -0.0027,
        "pipedream+nesterov (nadam)": 0.544,
        "pipeoptim (muon)": 0.1202,
        "gpipe (muon)": -0.0875,
        "pipeoptim+nesterov (muon)": 0.0644,
        "pipeoptim+bounded (muon)": 0.2425,
        "gpipe (basis-rotation)": -0.1105,
        "pipeoptim (basis-rotation)": -0.0076,
        "pipeoptim+nesterov (basis-rotation)": -0.0348,
    },
    32: {
        "gpipe": 0.0,
        "xpipe": 0.0602,
        "pipeoptim": 0.5575,
        "gpipe (muon)": -0.1088,
        "pipeoptim (muon)": 0.3296,
        "pipeoptim+nesterov (muon)": 0.3082,
        "gpipe (basis-rotation)": -0.151,
        "pipeoptim (basis-rotation)": 0.2339,
    },
}
"""Stages -> row -> its final test loss over **gpipe under AdamW** (the study's first
optimizer) at that depth, minus 1: what compares rows of two optimizers (``risk_fit.json``,
``depth_excess_first``; a test keeps them equal)."""

WITHIN = 0.03
"""A configuration within this share of gpipe's final loss counts as converging."""


def _method_of(row: str) -> Method | None:
    """The registered method a study row trains (None: a label that names none)."""
    return METHODS.get(split_row(row)[0].removesuffix(PREDICTED_BACKWARD))


def _asynchronous(row: str) -> bool:
    """The study row's method never flushes (``xpipe``, ``pipeoptim (muon)``...)."""
    method = _method_of(row)
    return method is not None and not method.flushes


def _micro_batched(row: str) -> bool:
    """The study row's method splits each mini-batch into micro-batches (``xpipe``)."""
    method = _method_of(row)
    return method is not None and not method.runs_whole_mini_batches


def split_row(row: str) -> tuple[str, str | None]:
    """A study row's method and the optimizer it names: ``M (O)`` -> (M, O), ``M`` ->
    (M, None)."""
    name, _, optimizer = row.partition(" (")
    return name, optimizer.removesuffix(")") or None


def join_row(method: str, optimizer: str | None) -> str:
    """The study row of ``method`` under ``optimizer`` (None: the study's first optimizer):
    :func:`split_row` undone."""
    return method if optimizer is None else f"{method} ({optimizer})"


PREDICTED_BACKWARD = "+Ŵbackward"
"""The suffix of a study row trained with ``Pipeline(predicted_backward=True)``."""


def _flags(row: str) -> str:
    """How to train a study row: ``--method M``, ``--optimizer O`` for ``M (O)``, and
    ``Pipeline(predicted_backward=True)`` for ``M+Ŵbackward``."""
    name, optimizer = split_row(row)
    base = name.removesuffix(PREDICTED_BACKWARD)
    flags = f"--method {base}" + (f" --optimizer {optimizer}" if optimizer else "")
    return flags + (", Pipeline(predicted_backward=True)" if base != name else "")


STUDY_FAMILY = {
    "adam": "adamw",
    "adamw": "adamw",
    "nadam": "nadam",
    "muon": "muon",
    "basis-rotation": "basis-rotation",
}
"""The study's optimizer rows a user's optimizer reads: AdamW's for Adam and AdamW (its rows
carry no optimizer in their names), NAdam's and Muon's as ``method (optimizer)``."""


def _other_optimizer(depth: int, family: str) -> str:
    """Where no never-micro-batched row of ``family`` converged at ``depth``: the best one
    of another optimizer that ends at or below gpipe's loss under ``family`` (its excess
    over gpipe under AdamW set against gpipe-under-``family``'s), with at most 2 weight
    copies per stage; "" where there is none."""
    first = DEPTH_EXCESS_FIRST.get(depth, {})
    reference = first.get(join_row("gpipe", None if family == "adamw" else family))
    if reference is None:
        return ""
    copies = DEPTH_COPIES.get(depth, {})
    rows = {
        row: (1.0 + e) / (1.0 + reference) - 1.0
        for row, e in first.items()
        if (split_row(row)[1] or "adamw") != family
        and _asynchronous(row)
        and not _micro_batched(row)
        and copies.get(row, 99) <= 2
    }
    good = {row: e for row, e in rows.items() if e <= WITHIN}
    if not good:
        return ""
    best = min(good, key=lambda row: good[row])
    e = good[best]
    where = f"{100 * -e:.1f} % below" if e < 0 else f"{100 * e:.1f} % above"
    return (
        f"; under another optimizer, {best} ended {where} gpipe's final loss under {family} "
        f"({_flags(best)})"
    )


def depth_advice(method: str, stages: int, optimizer: str) -> str | None:
    """A note for a user who picked ``method`` under ``optimizer`` at ``stages`` stages,
    where the study measured that row on its language model at that depth (or the nearest
    depth below where it measured it) more than :data:`WITHIN` above gpipe's final loss
    **under the same optimizer** (:data:`DEPTH_EXCESS`): what it measured, and the best
    configuration for that optimizer and depth, of the rows with at most 2 weight copies per
    stage: a never-micro-batched asynchronous row that came within :data:`WITHIN` first,
    then a micro-batched one (said so), else a synchronous method (said so, with the
    closest asynchronous row). None where nothing was measured or the method converged."""
    family = STUDY_FAMILY.get(optimizer)
    if family is None:
        return None
    mine = join_row(method, None if family == "adamw" else family)
    # some rows train at one depth only: the deepest at or below ``stages`` that has it
    depths = [p for p, rows in DEPTH_EXCESS.items() if p <= stages and mine in rows]
    if not depths:
        return None
    depth = max(depths)
    table = DEPTH_EXCESS[depth]
    excess = table[mine]
    if excess <= WITHIN:
        return None
    copies = DEPTH_COPIES.get(depth, {})
    ours = {
        row: e
        for row, e in table.items()
        if row != mine and (split_row(row)[1] or "adamw") == family and copies.get(row, 99) <= 2
    }
    converged = {row: e for row, e in ours.items() if e <= WITHIN and _asynchronous(row)}
    whole = {row: e for row, e in converged.items() if not _micro_batched(row)}
    closest = {row: e for row, e in ours.items() if _asynchronous(row)}

    def held(row: str) -> str:
        n = copies.get(row)
        return (
            "? weight copies" if n is None else "1 weight copy" if n == 1 else f"{n} weight copies"
        )

    def reached(e: float) -> str:
        return f"came within {100 * e:.1f} %" if e >= 0 else f"ended {100 * -e:.1f} % below gpipe's"

    under = f"under {family}"
    if whole or converged:
        pool = whole or converged
        best = min(pool, key=lambda row: pool[row])
        kind = "" if whole else "the best at this depth is micro-batched: "
        verdict = f"{kind}{best} {reached(pool[best])} with {held(best)} per stage ({_flags(best)})"
    else:
        zb = join_row("zb-h1", None if family == "adamw" else family)
        verdict = (
            f"nothing asynchronous {under} with at most 2 weight copies per stage came within "
            f"{100 * WITHIN:.0f} %: the best at this depth is a synchronous method (zb-h1 is "
            f"gpipe's updates with the smallest bubble; {_flags(zb)})"
        )
        if closest:
            near = min(closest, key=lambda row: closest[row])
            verdict += (
                f"; the closest asynchronous was {near} ({100 * closest[near]:+.1f} %, "
                f"{held(near)} per stage; {_flags(near)})"
            )
    if not whole:
        verdict += _other_optimizer(depth, family)
    return (
        f"{mine} at {stages} stages: on the convergence study's language model at {depth} "
        f"stages (gpt-deep, with warm-up, cosine decay and clipping) it ended "
        f"{100 * excess:+.1f} % over gpipe's final test loss {under} (every figure here is "
        f"against gpipe {under}); {verdict}. See docs/choosing-a-method.md, 'Choosing a "
        f"method at depth'"
    )
