"""The optimizer families, one module each: what ``--optimizer NAME`` builds, the options it
adds, the predictor that reads its state, and (through its torch-free entry in
``pipeoptim.plan.optimizer_families``) its default learning rate, state size and step cost.

A new family is one module here, its entry in the torch-free table, and one line in
:data:`TORCH_FAMILIES`.
"""

from __future__ import annotations

from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.families import (
    adam,
    any_torch,
    basis_rotation,
    muon,
    nadam,
    rmsprop,
    sgd,
)
from pipeoptim.runtime.optim.families.family import ShapedStateBytes, TorchOptimizerFamily
from pipeoptim.runtime.optim.predictors.base import WeightPredictor

__all__ = [
    "ANY_TORCH",
    "TORCH_FAMILIES",
    "ShapedStateBytes",
    "TorchOptimizerFamily",
    "own_predictor",
    "torch_family",
]

TORCH_FAMILIES: dict[str, TorchOptimizerFamily] = {
    f.name: f
    for f in (
        sgd.FAMILY,
        adam.ADAM,
        adam.ADAMW,
        rmsprop.FAMILY,
        nadam.FAMILY,
        muon.FAMILY,
        basis_rotation.FAMILY,
    )
}
"""Every family a user may name, by name (the names of the torch-free table)."""
ANY_TORCH = any_torch.FAMILY
"""The family of an optimizer none of :data:`TORCH_FAMILIES` builds."""

# Exact types: a subclass may change the update rule, and then only displacement is exact.
_PREDICTORS: dict[type[Optimizer], type[WeightPredictor]] = {
    cls: predictor
    for family in TORCH_FAMILIES.values()
    for cls, predictor in family.predicted_classes().items()
}


def torch_family(name: str) -> TorchOptimizerFamily:
    """The family named ``name``; an unknown name is refused with the names."""
    family = TORCH_FAMILIES.get(name)
    if family is None:
        raise RuntimeConfigError(
            f"unknown optimizer {name!r}; choose one of: {', '.join(TORCH_FAMILIES)}"
        )
    return family


def own_predictor(optimizer_class: type[Optimizer]) -> type[WeightPredictor]:
    """The predictor that reads an optimizer of exactly this class: its family's rule, or
    the last displacement (:data:`ANY_TORCH`) for any other class, a subclass included."""
    return _PREDICTORS.get(optimizer_class, ANY_TORCH.predictor)
