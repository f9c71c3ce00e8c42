"""Basis rotation: :class:`~pipeoptim.runtime.optim.basis_rotation.BasisRotation` (Adam in each
matrix's gradient eigenbasis, Jung et al., ICML 2026, Adam on the rest) with the paper's
defaults; its state is counted from the shapes (covariances and bases per matrix side)."""

from __future__ import annotations

from pipeoptim.plan.optimizer_families import optimizer_family
from pipeoptim.runtime.optim.basis_rotation import BasisRotation, state_bytes
from pipeoptim.runtime.optim.families.family import TorchOptimizerFamily
from pipeoptim.runtime.optim.predictors.matrix import BasisRotationPredictor

FAMILY = TorchOptimizerFamily(
    table=optimizer_family("basis-rotation"),
    optimizer_class=BasisRotation,
    predictor=BasisRotationPredictor,
    shaped_state_bytes=state_bytes,
)
