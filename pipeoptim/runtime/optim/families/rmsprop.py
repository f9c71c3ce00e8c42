"""RMSprop: torch.optim.RMSprop; its prediction reads the momentum buffer, or without momentum
the last applied displacement (``predictors.moments.RMSpropPredictor``)."""

from __future__ import annotations

from torch.optim import RMSprop

from pipeoptim.plan.optimizer_families import optimizer_family
from pipeoptim.runtime.optim.families.family import TorchOptimizerFamily
from pipeoptim.runtime.optim.predictors.moments import RMSpropPredictor

FAMILY = TorchOptimizerFamily(
    table=optimizer_family("rmsprop"), optimizer_class=RMSprop, predictor=RMSpropPredictor
)
