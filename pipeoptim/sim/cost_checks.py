"""The checks every value of a cost model passes: one number per stage (or edge), each a
number >= 0, weight-gradient shares in [0, 1], fixed seconds finite.

Kept apart from :mod:`pipeoptim.sim.costs` because its constructors
(:mod:`pipeoptim.sim.cost_sources`) check what they are given with the same rules and the
same messages (rule, values, fix).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeoptim.errors import PlanError

__all__ = ["per_stage", "seconds_or_none", "stage_floats", "stage_ints", "weight_grad_shares"]


def per_stage(name: str, values: float | Sequence[float], count: int) -> list[float]:
    """One value per stage (or edge): a single number is repeated ``count`` times."""
    raw = [values] * count if isinstance(values, (int, float)) else list(values)
    per = "edge" if name.endswith(" (per edge)") else "stage"
    base = name.removesuffix(" (per edge)")
    if len(raw) != count:
        raise PlanError(
            f"{base} needs one value per {per} (got {len(raw)} values for {count}); pass one "
            f"number or a list of {count}"
        )
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            where = f"link {i} (between stages {i} and {i + 1})" if per == "edge" else f"stage {i}"
            raise PlanError(
                f"the {base} of {where} must be a number >= 0 (got {v!r}); give a value >= 0"
            )
    return raw


def stage_floats(name: str, values: float | Sequence[float], count: int) -> tuple[float, ...]:
    return tuple(float(v) for v in per_stage(name, values, count))


def weight_grad_shares(values: object, count: int) -> tuple[float, ...]:
    """The per-stage weight-gradient shares: one number in [0, 1], or one per stage."""
    rule = "the share of a backward that computes the weight gradient"
    fix = "e.g. 0.5 (the zero-bubble paper's T_I = T_W), or re-profile"
    if not isinstance(values, (int, float)) and not (
        isinstance(values, Sequence) and not isinstance(values, str)
    ):
        raise PlanError(
            f"weight_grad_fraction must be a number in [0, 1] ({rule}) or one such number "
            f"per stage (got {values!r}); give {fix}"
        )
    raw = [values] * count if isinstance(values, (int, float)) else list(values)
    if len(raw) != count:
        raise PlanError(
            f"weight_grad_fraction needs one value per stage (got {len(raw)} values "
            f"{raw!r} for {count} stages); pass one number or a list of {count}"
        )
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise PlanError(
                f"the weight_grad_fraction of stage {i} must be a number in [0, 1], {rule} "
                f"(got {v!r}); give {fix}"
            )
    return tuple(float(v) for v in raw)


def seconds_or_none(value: object) -> float | None:
    """``value`` as seconds where it is a finite number >= 0 (a bool is not), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def stage_ints(name: str, values: int | Sequence[int], count: int) -> tuple[int, ...]:
    return tuple(int(v) for v in per_stage(name, values, count))
