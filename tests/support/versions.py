"""Weight versions of hand-written action lists, as a stage's tests read them."""

from __future__ import annotations

from pipeoptim.plan.actions import Action
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.versions import MicroBatchVersions, analyze_versions


def passes(method: str, text: str, micro_batches: int = 1) -> dict[int, MicroBatchVersions]:
    """Stage 0's versions for an action list like ``"0F0 0F1 0B0 0U0 0B1 0U1"``."""
    order = {0: [Action.parse(a) for a in text.split()]}
    report = analyze_versions(order, get_method(method).weight_policy, micro_batches)
    return {mb: v for (_, mb), v in report.passes.items()}
