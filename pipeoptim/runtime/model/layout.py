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
    num_layers: int, num_stages: int, boundaries: list[tuple[int, int]] | None, model: str
) -> list[tuple[int, int]]:
    """The plan's layer ranges, or an even split; checked against the model."""
    if num_stages > num_layers:
        raise RuntimeConfigError(
            f"model {model!r} has {num_layers} layers, too few for {num_stages} stages (a "
            f"stage holds at least one layer); use --stages {num_layers} or fewer"
        )
    bounds = boundaries or even_boundaries(num_layers, num_stages)
    if bounds[-1][1] != num_layers:
        raise RuntimeConfigError(
            f"the plan's stage boundaries cover {bounds[-1][1]} layers but model {model!r} "
            f"has {num_layers}; make the plan for this model"
        )
    return bounds
