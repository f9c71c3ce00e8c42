"""Muon: torch.optim.Muon takes only 2-D tensors, so the family builds
:class:`~pipeoptim.runtime.optim.optimizers.MuonWithAdamW` (Muon on the matrices, AdamW on the
rest, one lr for both); each part predicts by its own rule, and a bare torch.optim.Muon (a
user's factory) by the Muon rule."""

from __future__ import annotations

from torch.optim import Muon

from pipeoptim.plan.optimizer_families import optimizer_family
from pipeoptim.runtime.optim.families.family import TorchOptimizerFamily
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW
from pipeoptim.runtime.optim.predictors.matrix import MuonPredictor, MuonWithAdamWPredictor

FAMILY = TorchOptimizerFamily(
    table=optimizer_family("muon"),
    optimizer_class=MuonWithAdamW,
    predictor=MuonWithAdamWPredictor,
    also_predicts={Muon: MuonPredictor},
)
