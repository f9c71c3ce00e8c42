"""Any other torch optimizer (a user's factory returns it): no name to type, no class of its
own; its prediction repeats the last applied displacement, which is exact for any update rule
(``predictors.base.DisplacementPredictor``), and ZeRO does not shard it (its step may couple
parameters)."""

from __future__ import annotations

from pipeoptim.plan.optimizer_families import ANY_TORCH_OPTIMIZER
from pipeoptim.runtime.optim.families.family import TorchOptimizerFamily
from pipeoptim.runtime.optim.predictors.base import DisplacementPredictor

FAMILY = TorchOptimizerFamily(
    table=ANY_TORCH_OPTIMIZER,
    optimizer_class=None,
    predictor=DisplacementPredictor,
    steps_each_parameter_alone=False,
)
