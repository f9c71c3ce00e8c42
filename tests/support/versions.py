"""Weight versions of hand-written action lists, as a stage's tests read them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeoptim.plan.actions import Action
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.versions import MicroBatchVersions, analyze_versions
from pipeoptim.runtime.stage.stage import Stage


def passes(method: str, text: str, micro_batches: int = 1) -> dict[int, MicroBatchVersions]:
    """Stage 0's versions for an action list like ``"0F0 0F1 0B0 0U0 0B1 0U1"``."""
    order = {0: [Action.parse(a) for a in text.split()]}
    report = analyze_versions(order, get_method(method).weight_policy, micro_batches)
    return {mb: v for (_, mb), v in report.passes.items()}


def play(
    stage: Stage,
    text: str,
    *,
    shape: tuple[int, int, int] = (4, 3, 2),
    before: Callable[[str], None] | None = None,
) -> None:
    """Run the actions of ``text`` (``"0F0 0B0 0U0"``) on ``stage`` with random data: each
    forward a ``(batch, inputs)`` tensor, each backward a ``(batch, outputs)`` gradient,
    drawn in the actions' order; ``before`` sees each action first."""
    batch, inputs, outputs = shape
    for action in text.split():
        if before is not None:
            before(action)
        kind, mb = action[1], int(action[2:])
        if kind == "F":
            stage.forward(mb, torch.randn(batch, inputs))
        elif kind == "B":
            stage.backward(mb, torch.randn(batch, outputs))
        else:
            stage.update()
