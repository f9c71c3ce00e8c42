"""The convergence study's measured tables, kept as package data (``data/risk_tables.json``).

The risk model (:mod:`pipeoptim.plan.risk`) is code; the numbers it reads are measurements
that change whenever the study is rerun, so they live in a JSON file that
``examples/convergence/run.py --report-only`` rewrites from the committed study
(``examples/convergence/results``) and that a test holds equal to it. The file is read once
per process (:func:`packaged_risk_tables`); a malformed one is refused with the key and the
value that break the format.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pipeoptim.errors import PlanError
from pipeoptim.jsonfile import read_json
from pipeoptim.plan.delay_risk import RiskCurve

__all__ = [
    "CURVES",
    "GAIN_DELAY",
    "OPTIONAL_TABLES",
    "RiskTables",
    "packaged_risk_tables",
    "read_risk_tables",
    "risk_tables_from_json",
    "risk_tables_json",
]

PACKAGED = "risk_tables.json"
"""The file's name in ``pipeoptim/plan/data``."""

TABLES = (
    "closure",
    "kappa",
    "correction_gain",
    "depth_excess",
    "depth_copies",
    "depth_excess_first",
)
"""The tables a ``risk_tables.json`` holds, beside its ``meta``."""

OPTIONAL_TABLES = ("depth_speed", "depth_equal_time")
"""Tables a ``risk_tables.json`` may lack (a file written before the study measured time):
read as empty, written only where they hold a row."""

GAIN_DELAY = "correction_gain_delay"
"""The delays the corrections' gains were measured at (optional: an older file bounds none)."""

CURVES = "risk_curve"
"""The measured risk curves' table (optional like :data:`OPTIONAL_TABLES`: a file written
before them has none, and the risk model keeps κ)."""

REMEDY = (
    "regenerate it with `python examples/convergence/run.py --report-only` (from the "
    "committed study) or reinstall pipeoptim"
)


@dataclass(frozen=True)
class RiskTables:
    """The study's tables, as :mod:`pipeoptim.plan.risk` reads them (its constants of the
    same names, upper-case, document each)."""

    closure: dict[tuple[str, str], dict[int, float]]
    """(prediction rule, optimizer) -> {prediction distance s: share of it removed}."""
    kappa: dict[str, float]
    """Optimizer -> extra samples to target per update of uncorrected distance."""
    correction_gain: dict[str, float]
    """``correction/optimizer`` -> share of the base method's excess loss removed."""
    depth_excess: dict[int, dict[str, float]]
    """Stages -> study row -> final test loss over gpipe's under the same optimizer, - 1."""
    depth_copies: dict[int, dict[str, int]]
    """Stages -> study row -> weight copies on its fullest stage."""
    depth_excess_first: dict[int, dict[str, float]]
    """Stages -> study row -> final test loss over gpipe's under AdamW, - 1."""
    depth_speed: dict[int, dict[str, float]] = field(default_factory=dict)
    """Stages -> study row -> its simulated samples/s over zb-h1's under the same optimizer."""
    depth_equal_time: dict[int, dict[str, float]] = field(default_factory=dict)
    """Stages -> study row -> final test loss of its equal-time run over zb-h1's (gpipe's
    final under the same optimizer), - 1."""
    correction_gain_delay: dict[str, int] = field(default_factory=dict)
    """``correction/optimizer`` -> the longest stage-0 delay its gain was measured at."""
    risk_curve: dict[str, RiskCurve] = field(default_factory=dict)
    """Optimizer -> extra samples to target as a non-decreasing function of e
    (:mod:`pipeoptim.plan.delay_risk`)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Where the numbers come from and what regenerates them (free-form, not read)."""


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PlanError(
            f"risk tables: {where} must be a JSON object (got {type(value).__name__} "
            f"{value!r:.60}); {REMEDY}"
        )
    return value


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanError(f"risk tables: {where} must be a finite number (got {value!r}); {REMEDY}")
    return float(value)


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(f"risk tables: {where} must be an integer >= 0 (got {value!r}); {REMEDY}")
    return value


def _key_int(key: str, where: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise PlanError(
            f"risk tables: the keys of {where} are integers (got {key!r}); {REMEDY}"
        ) from None


def _numbers(value: object, where: str) -> dict[str, float]:
    return {k: _number(v, f"{where}[{k!r}]") for k, v in _mapping(value, where).items()}


def _by_depth(value: object, where: str, *, counts: bool = False) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for depth, rows in _mapping(value, where).items():
        at = f"{where}[{depth!r}]"
        read = _count if counts else _number
        out[_key_int(depth, where)] = {
            row: read(v, f"{at}[{row!r}]") for row, v in _mapping(rows, at).items()
        }
    return out


def risk_tables_from_json(data: object) -> RiskTables:
    """The tables of a parsed ``risk_tables.json`` (the format :func:`risk_tables_json`
    writes), each value checked."""
    top = _mapping(data, "the file")
    missing = [key for key in TABLES if key not in top]
    if missing:
        raise PlanError(f"risk tables: the file lacks the tables {missing}; {REMEDY}")
    closure: dict[tuple[str, str], dict[int, float]] = {}
    for rule, by_optimizer in _mapping(top["closure"], "closure").items():
        for optimizer, by_s in _mapping(by_optimizer, f"closure[{rule!r}]").items():
            at = f"closure[{rule!r}][{optimizer!r}]"
            closure[(rule, optimizer)] = {
                _key_int(s, at): _number(c, f"{at}[{s!r}]") for s, c in _mapping(by_s, at).items()
            }
    return RiskTables(
        closure=closure,
        kappa=_numbers(top["kappa"], "kappa"),
        correction_gain=_numbers(top["correction_gain"], "correction_gain"),
        depth_excess=_by_depth(top["depth_excess"], "depth_excess"),
        depth_copies=_by_depth(top["depth_copies"], "depth_copies", counts=True),
        depth_excess_first=_by_depth(top["depth_excess_first"], "depth_excess_first"),
        depth_speed=_by_depth(top.get("depth_speed", {}), "depth_speed"),
        depth_equal_time=_by_depth(top.get("depth_equal_time", {}), "depth_equal_time"),
        risk_curve={
            o: RiskCurve.from_json(v, f"{CURVES}[{o!r}]")
            for o, v in _mapping(top.get(CURVES, {}), CURVES).items()
        },
        correction_gain_delay={
            k: _count(v, f"{GAIN_DELAY}[{k!r}]")
            for k, v in _mapping(top.get(GAIN_DELAY, {}), GAIN_DELAY).items()
        },
        meta=dict(_mapping(top.get("meta", {}), "meta")),
    )


def risk_tables_json(tables: RiskTables) -> str:
    """``tables`` as the text of ``risk_tables.json``: keys in the tables' own order (the
    risk model's ties go to the first row), floats written exactly (``repr``); the
    :data:`OPTIONAL_TABLES` only where they hold something."""
    closure: dict[str, dict[str, dict[str, float]]] = {}
    for (rule, optimizer), by_s in tables.closure.items():
        closure.setdefault(rule, {})[optimizer] = {str(s): c for s, c in by_s.items()}

    def by_depth(table: Mapping[int, Mapping[str, float | int]]) -> dict[str, Any]:
        return {str(p): dict(rows) for p, rows in table.items()}

    data = {
        "meta": tables.meta,
        "closure": closure,
        "kappa": tables.kappa,
        "correction_gain": tables.correction_gain,
        "depth_excess": by_depth(tables.depth_excess),
        "depth_copies": by_depth(tables.depth_copies),
        "depth_excess_first": by_depth(tables.depth_excess_first),
    }
    # an older study's file (no time measured) is written back as it was
    for name in OPTIONAL_TABLES:
        table = getattr(tables, name)
        if table:
            data[name] = by_depth(table)
    if tables.correction_gain_delay:
        data[GAIN_DELAY] = tables.correction_gain_delay
    if tables.risk_curve:
        data[CURVES] = {o: c.to_json() for o, c in tables.risk_curve.items()}
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def read_risk_tables(path: str | Path) -> RiskTables:
    """The tables of the ``risk_tables.json`` at ``path``."""
    data = read_json(path, what="risk tables", remedy=REMEDY, error=PlanError)
    return risk_tables_from_json(data)


def packaged_path() -> Path:
    """The package's own ``risk_tables.json`` (inside an installed wheel too)."""
    return Path(str(resources.files("pipeoptim.plan") / "data" / PACKAGED))


@cache
def packaged_risk_tables() -> RiskTables:
    """The package's tables, read once per process. Callers copy what they change: the
    same object is handed to every caller."""
    return read_risk_tables(packaged_path())
