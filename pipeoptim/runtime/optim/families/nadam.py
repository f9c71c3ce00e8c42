"""NAdam: torch.optim.NAdam; its prediction is Adam's with the next step's Nesterov factor
(``predictors.moments.NAdamPredictor``)."""

from __future__ import annotations

from torch.optim import NAdam

from pipeoptim.plan.optimizer_families import optimizer_family
from pipeoptim.runtime.optim.families.family import TorchOptimizerFamily
from pipeoptim.runtime.optim.predictors.moments import NAdamPredictor

FAMILY = TorchOptimizerFamily(
    table=optimizer_family("nadam"), optimizer_class=NAdam, predictor=NAdamPredictor
)
