"""Adam and AdamW: torch's own classes; both predict from the bias-corrected moments
(``predictors.moments.AdamPredictor``), AdamW's decoupled decay added only when asked."""

from __future__ import annotations

from torch.optim import Adam, AdamW

from pipeoptim.plan.optimizer_families import optimizer_family
from pipeoptim.runtime.optim.families.family import TorchOptimizerFamily
from pipeoptim.runtime.optim.predictors.moments import AdamPredictor

ADAM = TorchOptimizerFamily(
    table=optimizer_family("adam"), optimizer_class=Adam, predictor=AdamPredictor
)
ADAMW = TorchOptimizerFamily(
    table=optimizer_family("adamw"), optimizer_class=AdamW, predictor=AdamPredictor
)
