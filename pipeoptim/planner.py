"""Kept so that ``from pipeoptim.planner import ...`` still works: plan search lives in
:mod:`pipeoptim.planning`."""

from pipeoptim.planning.candidate import (
    Candidate,
    micro_batch_options,
    per_unit_profile,
    skipped_candidate,
)
from pipeoptim.planning.evaluate import evaluate_candidate
from pipeoptim.planning.explain import (
    describe_staleness,
    explain,
    format_rate,
    memory_choice,
    memory_notes,
)
from pipeoptim.planning.stage_search import rank, search

__all__ = [
    "Candidate",
    "describe_staleness",
    "evaluate_candidate",
    "explain",
    "format_rate",
    "memory_choice",
    "memory_notes",
    "micro_batch_options",
    "per_unit_profile",
    "rank",
    "search",
    "skipped_candidate",
]
