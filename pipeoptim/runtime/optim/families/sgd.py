"""SGD: torch.optim.SGD with momentum 0.9 unless the plan says otherwise; its prediction reads
the momentum buffer (``predictors.moments.SGDPredictor``)."""

from __future__ import annotations

from torch.optim import SGD

from pipeoptim.plan.optimizer_families import optimizer_family
from pipeoptim.runtime.optim.families.family import TorchOptimizerFamily
from pipeoptim.runtime.optim.predictors.moments import SGDPredictor

FAMILY = TorchOptimizerFamily(
    table=optimizer_family("sgd"),
    optimizer_class=SGD,
    predictor=SGDPredictor,
    default_options={"momentum": 0.9},
)
