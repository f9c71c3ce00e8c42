"""Which layers each stage holds: the plan's stage boundaries checked against the model.

A plan may give its boundaries (a partition the planner chose) or leave them out (an even
split of the layers); either way a run must refuse a layout that does not fit the model it
is given, before any stage is built. The check is the runtime's own, so it lives here and
not with the built-in workloads (which the runtime never imports); torch-free.
"""

from __future__ import annotations

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import even_boundaries

__all__ = ["stage_boundaries"]


def stage_boundaries(
    num_layers: int,
    num_stages: int,
    boundaries: list[tuple[int, int]] | None,
    model: str | None,
    *,
    virtual_stages: int = 1,
    method: str | None = None,
    stages_flag: str = "stages=",
) -> list[tuple[int, int]]:
    """The plan's layer ranges, or an even split; checked against the model.

    ``num_stages`` counts every stage (ranks × ``virtual_stages``); ``model`` is the model's
    name where it has one (None: the user's layers); ``stages_flag`` is how the caller's user
    sets the rank count (``stages=`` for a Pipeline, ``--stages `` on the command line)."""
    name = f"model {model!r}" if model else "the model"
    if num_stages > num_layers:
        raise RuntimeConfigError(
            _too_few(num_layers, num_stages, name, virtual_stages, method, stages_flag)
        )
    bounds = boundaries or even_boundaries(num_layers, num_stages)
    if bounds[-1][1] != num_layers:
        raise RuntimeConfigError(
            f"the plan's stage boundaries cover {bounds[-1][1]} layers but {name} "
            f"has {num_layers}; make the plan for this model"
        )
    return bounds


def _too_few(
    layers: int, stages: int, name: str, virtual: int, method: str | None, flag: str
) -> str:
    """Why ``layers`` cannot fill ``stages`` stages, and a rank count that can."""
    if virtual <= 1:
        return (
            f"{name} has {layers} layers, too few for {stages} stages (a stage holds at least "
            f"one layer); use {flag}{layers} or fewer, or a model with more layers"
        )
    ranks = stages // virtual
    most = layers // virtual
    fix = (
        f"use {flag}{most} or fewer"
        if most >= 1
        else "use a method with one stage per rank (gpipe, 1f1b, zb-h1...)"
    )
    return (
        f"{name} has {layers} layers, too few for {method or 'the method'}'s {stages} stages "
        f"({virtual} per rank on {ranks} ranks; a stage holds at least one layer, so "
        f"{virtual}·P layers are needed); {fix}, or a model with more layers"
    )
