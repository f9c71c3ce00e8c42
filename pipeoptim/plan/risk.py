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
relative to a synchronous method, read at the stage with the largest e (stage 0 in an
asynchronous 1F1B) off the optimizer's **measured risk curve** (:data:`RISK_CURVE`,
:mod:`pipeoptim.plan.delay_risk`: the non-decreasing fit of the study's samples-to-target
against e, which holds that one update of delay is cheap and a few are not); an optimizer
the study measured too little for a curve keeps the straight line ``risk = κ_optimizer · e``
fitted through the origin (:data:`KAPPA`). The planner ranks candidates by
``throughput / (1 + risk)``: samples per second that count toward accuracy.

The constants are from small models (digits MLP and CNN, a character GPT) and are a
first-order guide, not a guarantee; the study's command re-measures them on a user's model.
They are package data (``pipeoptim/plan/data/risk_tables.json``, read by
:mod:`pipeoptim.plan.risk_tables`), which ``examples/convergence/run.py --report-only``
rewrites from the study's ``risk_fit.json``; a test holds the file to the committed study.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache, partial
from typing import Any

from pipeoptim.plan.delay_risk import RiskCurve
from pipeoptim.plan.methods import METHODS, Method, WeightPolicy, get_method
from pipeoptim.plan.risk_tables import packaged_risk_tables
from pipeoptim.plan.versions import analyze_versions

__all__ = [
    "CLOSURE",
    "CORRECTION_GAIN",
    "CORRECTION_GAIN_DELAY",
    "DEPTH_COPIES",
    "DEPTH_EQUAL_TIME",
    "DEPTH_EXCESS",
    "DEPTH_SPEED",
    "KAPPA",
    "RISK_CURVE",
    "MethodRisk",
    "RiskFitPoint",
    "StudyRow",
    "closure",
    "closure_from_rows",
    "correction_gain",
    "depth_advice",
    "faster_to_target",
    "fit_risk",
    "gain_delay_table",
    "gain_table",
    "join_row",
    "method_risk",
    "parse_row",
    "row_label",
    "schedule_versions",
    "split_row",
    "uncorrected_distance",
]

_TABLES = packaged_risk_tables()
"""The study's measured tables; the constants below are copies of them, so a caller (a test)
may change a constant without changing what other readers of the package data see."""

CLOSURE: dict[tuple[str, str], dict[int, float]] = {
    key: dict(by_s) for key, by_s in _TABLES.closure.items()
}
"""(prediction rule, optimizer) -> {s: share of the stale distance removed}: per stage, the
median over its predicted forwards, averaged over the study's models and depths
(``risk_fit.json``, ``closure_table``; ``risk_tables.json``, ``closure``).
Not monotone in s everywhere: stages with the same s sit at different depths and models."""

KAPPA: dict[str, float] = dict(_TABLES.kappa)
"""Optimizer -> extra samples to target per update of uncorrected distance, fitted through
the origin over the digits MLP and CNN (3 seeds), the GPT (AdamW, 1 seed) and the language
model at depth (gpt-deep at 4, 8 and 16 stages: AdamW, and the NAdam and Muon rows against
gpipe under NAdam and Muon) at the rates the gpipe sweep chose (``risk_fit.json``,
``kappa``). A seed that never reached a fixed target counts as the whole run, so SGD's κ is
a lower bound where deep pipelines failed outright; gpt-deep's extra is read off gpipe's
curve (the samples gpipe needed for the loss the method ended with)."""

CORRECTION_GAIN: dict[str, float] = dict(_TABLES.correction_gain)
"""``correction/optimizer`` -> the share of its base method's excess final test loss over
gpipe's that the delay correction removed on the study's language model at depth
(``gpt-deep``; 1: all of it, 0: none, < 0: worse), the mean over the depths measured
(``risk_fit.json`` and ``risk_tables.json``, ``correction_gain``). A corrected method's
uncorrected distance is its base's times ``1 − gain``; an unmeasured pair gains nothing,
so the planner ranks it level with its base, and the base, registered first, wins."""

RISK_CURVE: dict[str, RiskCurve] = dict(_TABLES.risk_curve)
"""Optimizer -> extra samples to target as a non-decreasing function of the uncorrected
distance e, fitted to every model's points of the study (``risk_fit.json`` and
``risk_tables.json``, ``risk_curve``); where an optimizer has one, :func:`method_risk`
reads it in place of κ·e."""

CORRECTION_GAIN_DELAY: dict[str, int] = dict(_TABLES.correction_gain_delay)
"""``correction/optimizer`` -> the longest stage-0 delay (updates) its gain in
:data:`CORRECTION_GAIN` was measured at; a stage further behind gets no gain from it
(``risk_tables.json``, ``correction_gain_delay``; absent: no bound)."""

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
    method: str | Method,
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
    spec = method if isinstance(method, Method) else get_method(method)
    policy = spec.version_rule
    # per missed update: the share the correction keeps, of the A_k mini-batches it carries
    delay = max(max_distance, max_staleness)
    kept = (1.0 - correction_gain(spec.correction, optimizer, delay)) * accumulation
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
    """The optimizer's κ (extra samples per update of e on the straight-line fit)."""
    curve: RiskCurve | None = None
    """The measured risk curve ``risk`` was read off (None: ``risk = kappa · e``)."""


def method_risk(
    method: str | Method,
    optimizer: str,
    distances: Iterable[int],
    staleness: Iterable[int],
    kappa: Mapping[str, float] | None = None,
) -> MethodRisk:
    """Risk of ``method`` from the per-stage distances and staleness of its schedule: the
    optimizer's measured curve at the largest e (:data:`RISK_CURVE`), else κ·e; a given
    ``kappa`` asks for the straight line with those κ."""
    ds, st = tuple(distances), tuple(staleness)
    spec = method if isinstance(method, Method) else get_method(method)
    rule = spec.predictor or "optimizer"
    p = len(ds)
    es = [
        uncorrected_distance(spec, optimizer, s, old, accumulation=spec.accumulation(k, p))
        for k, (s, old) in enumerate(zip(ds, st, strict=True))
    ]
    worst = max(range(len(es)), key=lambda k: es[k], default=0)
    e = es[worst] if es else 0.0
    closed = closure(rule, optimizer, ds[worst]) if spec.predicts and ds else None
    k = (kappa or KAPPA).get(optimizer, DEFAULT_KAPPA)
    curve = None if kappa is not None else RISK_CURVE.get(optimizer)
    risk = curve(e) if curve is not None else k * e
    return MethodRisk(ds, st, e, closed, risk, k, curve)


@lru_cache(maxsize=1024)
def schedule_versions(
    method: str, num_stages: int, micro_batches: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage, the largest prediction distance s and staleness of ``method``'s schedule
    at ``micro_batches`` (None: the method's default M; a run long enough to reach the
    steady state). Kept per arguments: the methods are fixed classes, and a deep schedule
    (32 stages of xpipe: 137,280 actions) takes over a second to build and walk."""
    spec = get_method(method)
    m = micro_batches if micro_batches is not None else spec.default_micro_batches_at(num_stages)
    m = spec.micro_batches_for(m)
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


def gain_delay_table(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """:data:`CORRECTION_GAIN_DELAY` from the study's gain rows: per
    ``correction/optimizer``, the longest stage-0 delay (updates) a gain was measured at
    (rows written before the delay was recorded bound nothing)."""
    out: dict[str, int] = {}
    for row in rows:
        if "delay" in row:
            key = f"{row['correction']}/{row['optimizer']}"
            out[key] = max(out.get(key, 0), int(row["delay"]))
    return dict(sorted(out.items()))


def correction_gain(correction: str | None, optimizer: str, delay: int | None = None) -> float:
    """The measured gain of ``correction`` under ``optimizer`` (0 where unmeasured, and on
    a stage whose ``delay`` is longer than any the gain was measured at: a correction that
    closed a one-update delay says nothing of seven)."""
    if correction is None:
        return 0.0
    key = f"{correction}/{optimizer}"
    longest = CORRECTION_GAIN_DELAY.get(key)
    if delay is not None and longest is not None and delay > longest:
        return 0.0
    return CORRECTION_GAIN.get(key, 0.0)


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
    p: dict(rows) for p, rows in _TABLES.depth_excess.items()
}
"""Stages -> row of the study's language-model table (a method, ``method (optimizer)`` for
another optimizer) -> its final test loss over gpipe's **under the same optimizer** at that
depth, minus 1 (``gpipe (muon)`` for a Muon row; ``gpt-deep``, AdamW's rate and recipe;
``risk_fit.json`` and ``risk_tables.json``, ``depth_excess``)."""

DEPTH_COPIES: dict[int, dict[str, int]] = {
    p: dict(rows) for p, rows in _TABLES.depth_copies.items()
}
"""The weight copies each row of :data:`DEPTH_EXCESS` keeps on its fullest stage."""

DEPTH_SPEED: dict[int, dict[str, float]] = {
    p: dict(rows) for p, rows in _TABLES.depth_speed.items()
}
"""Stages -> row of :data:`DEPTH_EXCESS` -> its simulated samples/s over zb-h1's under the
same optimizer, at the row's own micro-batches (the study's profile of ``gpt-deep``;
``risk_tables.json``, ``depth_speed``; empty in a table written before the study measured
time)."""

DEPTH_EQUAL_TIME: dict[int, dict[str, float]] = {
    p: dict(rows) for p, rows in _TABLES.depth_equal_time.items()
}
"""Stages -> row -> the final test loss of its equal-time run (as many updates as its
throughput buys in zb-h1's time for the study's updates) over zb-h1's loss in that time
(gpipe's final under the same optimizer), minus 1; only rows whose equal-time run is on file
(``risk_tables.json``, ``depth_equal_time``)."""

DEPTH_EXCESS_FIRST: dict[int, dict[str, float]] = {
    p: dict(rows) for p, rows in _TABLES.depth_excess_first.items()
}
"""Stages -> row -> its final test loss over **gpipe under AdamW** (the study's first
optimizer) at that depth, minus 1: what compares rows of two optimizers (``risk_fit.json``
and ``risk_tables.json``, ``depth_excess_first``)."""

WITHIN = 0.03
"""A configuration within this share of gpipe's final loss counts as converging."""


def _method_of(row: str) -> Method | None:
    """The registered method a study row trains (None: a label that names none)."""
    return METHODS.get(parse_row(row).method)


def _asynchronous(row: str) -> bool:
    """The study row's method never flushes (``xpipe``, ``pipeoptim (muon)``...)."""
    method = _method_of(row)
    return method is not None and not method.flushes


def _micro_batched(row: str) -> bool:
    """The study row splits each mini-batch into micro-batches (``xpipe``, a dial row
    ``pipeoptim M=2``)."""
    method = _method_of(row)
    if method is None:
        return False
    m = parse_row(row).micro_batches
    return method.micro_batched_by_default if m is None else m > 1


def split_row(row: str) -> tuple[str, str | None]:
    """A study row's name and the optimizer it names: ``M (O)`` -> (M, O), ``M`` ->
    (M, None). The name keeps the row's settings (``pipeoptim M=2``: :func:`parse_row`)."""
    name, _, optimizer = row.partition(" (")
    return name, optimizer.removesuffix(")") or None


MICRO_BATCHES = "M="
"""A row's setting of its micro-batches per update, where not its method's default
(``pipeoptim M=2``: the dial between PipeOptim and XPipe)."""

EXTRAPOLATION = "λ="
"""A row's setting of the extrapolation's λ (``xpipe+extrapolate λ=0.5``)."""


@dataclass(frozen=True)
class StudyRow:
    """A study row's label read apart (:func:`parse_row`; :func:`row_label` writes it)."""

    method: str
    """The method the row trains, without the predicted-backward suffix."""
    optimizer: str | None
    """The optimizer the row names (None: the study's first optimizer)."""
    micro_batches: int | None = None
    """Micro-batches per update where not the method's default (None: the default)."""
    extrapolation: float | None = None
    """The extrapolation's λ where set (None: the correction's default)."""
    predicted_backward: bool = False
    """Trained with ``Pipeline(predicted_backward=True)`` (``+Ŵbackward``)."""


def row_label(
    method: str,
    optimizer: str | None = None,
    *,
    micro_batches: int | None = None,
    extrapolation: float | None = None,
    predicted_backward: bool = False,
) -> str:
    """The study row of ``method`` with its settings, under ``optimizer``:
    ``pipeoptim M=2 (muon)``, ``xpipe+extrapolate λ=0.5``; :func:`parse_row` undone."""
    name = method + (PREDICTED_BACKWARD if predicted_backward else "")
    if micro_batches is not None:
        name += f" {MICRO_BATCHES}{micro_batches}"
    if extrapolation is not None:
        name += f" {EXTRAPOLATION}{extrapolation:g}"
    return join_row(name, optimizer)


def parse_row(row: str) -> StudyRow:
    """A study row's method, optimizer and settings (:func:`row_label` undone); a setting it
    does not know is left in the method's name (which then names no registered method)."""
    name, optimizer = split_row(row)
    head, *settings = name.split(" ")
    micro: int | None = None
    lam: float | None = None
    rest = []
    for setting in settings:
        if setting.startswith(MICRO_BATCHES) and setting[len(MICRO_BATCHES) :].isdigit():
            micro = int(setting[len(MICRO_BATCHES) :])
        elif setting.startswith(EXTRAPOLATION):
            try:
                lam = float(setting[len(EXTRAPOLATION) :])
            except ValueError:
                rest.append(setting)
        else:
            rest.append(setting)
    method = " ".join([head, *rest])
    backward = method.endswith(PREDICTED_BACKWARD)
    return StudyRow(method.removesuffix(PREDICTED_BACKWARD), optimizer, micro, lam, backward)


def join_row(method: str, optimizer: str | None) -> str:
    """The study row of ``method`` under ``optimizer`` (None: the study's first optimizer):
    :func:`split_row` undone."""
    return method if optimizer is None else f"{method} ({optimizer})"


PREDICTED_BACKWARD = "+Ŵbackward"
"""The suffix of a study row trained with ``Pipeline(predicted_backward=True)``."""


def _flags(row: str) -> str:
    """How to train a study row: ``--method M``, ``--micro-batches N`` for ``M M=N``,
    ``--extrapolation L`` for ``M λ=L``, ``--optimizer O`` for ``M (O)``, and
    ``Pipeline(predicted_backward=True)`` for ``M+Ŵbackward``."""
    parts = parse_row(row)
    flags = f"--method {parts.method}"
    if parts.micro_batches is not None:
        flags += f" --micro-batches {parts.micro_batches}"
    if parts.extrapolation is not None:
        flags += f" --extrapolation {parts.extrapolation:g}"
    if parts.optimizer:
        flags += f" --optimizer {parts.optimizer}"
    return flags + (", Pipeline(predicted_backward=True)" if parts.predicted_backward else "")


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


def _held(copies: Mapping[str, int], row: str) -> str:
    n = copies.get(row)
    return "? weight copies" if n is None else "1 weight copy" if n == 1 else f"{n} weight copies"


_STUDY = (
    "on the convergence study's language model at {depth} stages (gpt-deep, with warm-up, "
    "cosine decay and clipping)"
)
_SEE = "See docs/choosing-a-method.md, 'Choosing a method at depth'"


def _user_row(method: str, stages: int, family: str, micro_batches: int | None) -> str:
    """The study row of the user's choice: ``pipeoptim M=4 (muon)`` where ``micro_batches``
    is not the method's default at ``stages``."""
    spec = METHODS.get(method)
    m = micro_batches
    if spec is None or m is None or m == spec.default_micro_batches_at(stages):
        m = None
    return row_label(method, None if family == "adamw" else family, micro_batches=m)


def _time_numbers(depth: int, row: str) -> str:
    """The time tables' figures of ``row`` at ``depth``, each only where measured."""
    parts = []
    speed = DEPTH_SPEED.get(depth, {}).get(row)
    if speed is not None:
        parts.append(f"{speed:.2f}× zb-h1's samples/s")
    excess = DEPTH_EXCESS.get(depth, {}).get(row)
    if excess is not None:
        parts.append(f"{100 * excess:+.1f} % over gpipe's final loss at equal samples")
    equal = DEPTH_EQUAL_TIME.get(depth, {}).get(row)
    if equal is not None:
        parts.append(f"{100 * equal:+.1f} % against zb-h1's loss in zb-h1's time")
    return ", ".join(parts)


def faster_to_target(depth: int, family: str) -> list[str]:
    """The asynchronous rows of ``family`` at ``depth`` with at most 2 weight copies per stage
    that reach the target sooner than zb-h1 under the same optimizer, best first:

    1. rows whose equal-time run ended below zb-h1's loss in the same time
       (:data:`DEPTH_EQUAL_TIME` < 0), lowest loss first: measured, the user's question;
    2. rows with no equal-time run that came within :data:`WITHIN` of gpipe's final loss at
       equal samples (:data:`DEPTH_EXCESS`) at a simulated speed over zb-h1's
       (:data:`DEPTH_SPEED`) above 1, fastest first (ties: the lower excess). Such a row
       reaches the study's target (gpipe's final loss + :data:`WITHIN`) within the run; its
       time to it against zb-h1's is (its samples to the target / gpipe's) / speed, and the
       tables carry the speed and the excess, not the samples ratio, so this rule is a
       screen whose two figures the advice prints side by side, not a measured time.

    A row missing a figure its rule needs is skipped."""
    copies = DEPTH_COPIES.get(depth, {})
    excess, speed = DEPTH_EXCESS.get(depth, {}), DEPTH_SPEED.get(depth, {})
    equal = DEPTH_EQUAL_TIME.get(depth, {})
    rows = [
        row
        for row in dict.fromkeys([*excess, *equal])
        if (split_row(row)[1] or "adamw") == family
        and _asynchronous(row)
        and copies.get(row, 99) <= 2
    ]
    measured = sorted((r for r in rows if equal.get(r, 0.0) < 0), key=lambda r: equal[r])
    predicted = sorted(
        (
            r
            for r in rows
            if r not in equal and excess.get(r, math.inf) <= WITHIN and speed.get(r, 0.0) > 1
        ),
        key=lambda r: (-speed[r], excess[r]),
    )
    return measured + predicted


def _closest(depth: int, family: str) -> str | None:
    """The asynchronous row of ``family`` at ``depth`` (at most 2 weight copies per stage)
    nearest synchronous quality: the lowest equal-time loss where any was measured, else the
    lowest excess at equal samples (None: no such row)."""
    copies = DEPTH_COPIES.get(depth, {})

    def ours(table: Mapping[str, float]) -> dict[str, float]:
        return {
            row: v
            for row, v in table.items()
            if (split_row(row)[1] or "adamw") == family
            and _asynchronous(row)
            and copies.get(row, 99) <= 2
        }

    for table in (ours(DEPTH_EQUAL_TIME.get(depth, {})), ours(DEPTH_EXCESS.get(depth, {}))):
        if table:
            return min(table, key=lambda row: table[row])
    return None


def depth_advice(
    method: str, stages: int, optimizer: str, micro_batches: int | None = None
) -> str | None:
    """A note for a user who picked ``method`` (at ``micro_batches`` per update; None: its
    default) under ``optimizer`` at ``stages`` stages: what the convergence study measured
    on its language model at that depth, or the nearest depth below where it measured the
    row (a synchronous method: where it measured gpipe under that optimizer), and the
    configuration **faster to the target** there, with its numbers and flags.

    Where the study measured time at that depth (:data:`DEPTH_SPEED`,
    :data:`DEPTH_EQUAL_TIME`), the recommendation is the first of :func:`faster_to_target`
    (an asynchronous configuration faster than zb-h1 under the same optimizer), else the
    synchronous zb-h1 with the figures of the closest asynchronous row. None where the
    user's choice is already the recommendation (that row; any synchronous method where the
    recommendation is synchronous), or where the optimizer was not measured; a row the study
    did not train (another M) is said so, with no figure of its own. Where it measured no
    time, the advice is by loss alone (:func:`_loss_advice`), for measured rows only."""
    family = STUDY_FAMILY.get(optimizer)
    spec = METHODS.get(method)
    if family is None or spec is None:
        return None
    mine = _user_row(method, stages, family, micro_batches)
    gpipe = join_row("gpipe", None if family == "adamw" else family)
    # some rows train at one depth only: the deepest at or below ``stages`` that has it; a
    # synchronous method (gpipe's updates) or a row the study never trained (another M):
    # where gpipe under that optimizer trained
    measured = [p for p, rows in DEPTH_EXCESS.items() if p <= stages and mine in rows]
    depths = measured or [p for p, rows in DEPTH_EXCESS.items() if p <= stages and gpipe in rows]
    if not depths:
        return None
    depth = max(depths)
    if not DEPTH_SPEED.get(depth) and not DEPTH_EQUAL_TIME.get(depth):
        if spec.flushes or not measured:
            return None
        return _loss_advice(mine, depth, stages, family)
    copies = DEPTH_COPIES.get(depth, {})
    ranked = faster_to_target(depth, family)
    best = ranked[0] if ranked else None
    if best == mine or (best is None and spec.flushes):
        return None
    zb = join_row("zb-h1", None if family == "adamw" else family)
    if spec.flushes:
        said = f"{method} is synchronous, gpipe's updates at its own speed"
    else:
        said = f"it measured {_time_numbers(depth, mine)}"
    head = (
        f"{mine} at {stages} stages: {_STUDY.format(depth=depth)} {said} (every figure "
        f"against zb-h1 and gpipe under {family})"
    )
    if not spec.flushes and not measured:
        head = (
            f"{mine} at {stages} stages: the convergence study did not train it; "
            f"{_STUDY.format(depth=depth)}, every figure against zb-h1 and gpipe under {family}"
        )
    if best is not None:
        # say only what was measured: a lower loss in zb-h1's time, or the screen's speed
        # and loss (its time to gpipe's loss is then not measured)
        beats = DEPTH_EQUAL_TIME.get(depth, {}).get(best, math.inf) < 0
        claim = (
            "an asynchronous configuration ends lower than zb-h1 in zb-h1's time"
            if beats
            else "an asynchronous configuration is faster per sample than zb-h1 and ended "
            f"within {100 * WITHIN:.0f} % of gpipe's loss at equal samples (its time to that "
            "loss not measured)"
        )
        verdict = (
            f"{claim}: {best} "
            f"({_time_numbers(depth, best)}; {_held(copies, best)} per stage; {_flags(best)})"
        )
    else:
        verdict = (
            f"nothing asynchronous with at most 2 weight copies per stage reaches gpipe's loss "
            f"sooner than zb-h1: the best at this depth is the synchronous zb-h1 (gpipe's "
            f"updates with the smallest bubble; {_flags(zb)})"
        )
        near = _closest(depth, family)
        if near is not None:
            verdict += (
                f"; the closest asynchronous was {near} ({_time_numbers(depth, near)}; "
                f"{_held(copies, near)} per stage; {_flags(near)})"
            )
        verdict += _other_optimizer(depth, family)
    return f"{head}; {verdict}. {_SEE}"


def _loss_advice(mine: str, depth: int, stages: int, family: str) -> str | None:
    """The advice at a depth where the study measured no time (a table written before it
    did): by loss at equal samples alone. Silent where ``mine`` converged (within
    :data:`WITHIN`); else the best of the rows with at most 2 weight copies per stage: a
    never-micro-batched asynchronous row that came within :data:`WITHIN` first, then a
    micro-batched one (said so), else a synchronous method (said so, with the closest
    asynchronous row)."""
    table = DEPTH_EXCESS[depth]
    excess = table[mine]
    if excess <= WITHIN:
        return None
    copies = DEPTH_COPIES.get(depth, {})
    held = partial(_held, copies)
    ours = {
        row: e
        for row, e in table.items()
        if row != mine and (split_row(row)[1] or "adamw") == family and copies.get(row, 99) <= 2
    }
    converged = {row: e for row, e in ours.items() if e <= WITHIN and _asynchronous(row)}
    whole = {row: e for row, e in converged.items() if not _micro_batched(row)}
    closest = {row: e for row, e in ours.items() if _asynchronous(row)}

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
        f"{mine} at {stages} stages: {_STUDY.format(depth=depth)} it ended "
        f"{100 * excess:+.1f} % over gpipe's final test loss {under} (every figure here is "
        f"against gpipe {under}); {verdict}. {_SEE}"
    )
