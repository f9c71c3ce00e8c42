"""Unit costs for the simulator's tests: unequal stages and predictions."""

from __future__ import annotations

import dataclasses

from pipeoptim.sim.costs import CostModel


def unequal_costs(stages: int) -> CostModel:
    base = CostModel.uniform(stages, 1.0, 2.0, 0.25, latency_s=0.05, bandwidth=1e4)
    return dataclasses.replace(
        base,
        forward_s=tuple(0.5 + 0.25 * (k % 3) for k in range(stages)),
        predict_s=tuple(0.1 * (k + 1) for k in range(stages)),
        prediction_setup_s=tuple(0.0625 * (k + 1) for k in range(stages)),
    )
