"""A model cut into pipeline units, with what the units alone do not know of it.

``Pipeline`` trains a list of units; this says, besides the units, how each unit's tensors are
named in the user's own model (for :meth:`Pipeline.export`), how to initialise a unit built on
the meta device (each rank materialises only its own stage's units), the loss the model is
trained with, and, for a Hugging Face model, its class and config (so the export is a folder
``from_pretrained`` loads).

    cut = ModelUnits.from_model(model, [model.embed, *model.blocks, model.head])
    pipe = Pipeline(cut, method="gpipe", stages=2)

Why a record rather than attributes on the units: the units are the user's modules (or a Hugging
Face model's), and the names are a property of the whole model, read once before anything is
moved, cloned or materialised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.recompute import UnitLabels
from pipeoptim.runtime.stage.loss import LossFn

__all__ = ["InitWeights", "ModelUnits", "as_model_units", "source_names", "unit_labels"]

InitWeights = Callable[[int, nn.Module], None]
"""``init_weights(index, unit)``: give the unit's parameters and buffers their initial values
in place, after the unit was moved from the meta device to the rank's device (``to_empty``),
under a random stream seeded from the run's seed and the unit's index."""


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter and persistent buffer under its ``state_dict`` key (tied tensors under
    each of their names)."""
    return dict(module.state_dict(keep_vars=True))


def source_names(model: nn.Module, units: Sequence[nn.Module]) -> list[dict[str, list[str]]]:
    """For each unit, its ``state_dict`` keys -> the keys of the same tensors in ``model``'s
    ``state_dict`` (one tensor may have several names: a tied embedding). A unit tensor that
    ``model`` does not hold is refused: the units must be parts of the model."""
    by_tensor: dict[int, list[str]] = {}
    for name, t in _tensors(model).items():
        by_tensor.setdefault(id(t), []).append(name)
    out: list[dict[str, list[str]]] = []
    for i, unit in enumerate(units):
        names: dict[str, list[str]] = {}
        for key, t in _tensors(unit).items():
            found = by_tensor.get(id(t))
            if found is None:
                raise RuntimeConfigError(
                    f"unit {i} ({type(unit).__name__}) holds {key!r}, which the model "
                    f"({type(model).__name__}) does not: the units must be the model's own "
                    f"modules (not copies); build them from the model's submodules"
                )
            names[key] = list(found)
        out.append(names)
    return out


@dataclass
class ModelUnits:
    """Units of one model, in pipeline order, and what export and materialisation need."""

    units: list[nn.Module]
    """The units, in order; a stage holds consecutive units."""
    names: list[dict[str, list[str]]] | None = None
    """Per unit: its ``state_dict`` key -> that tensor's keys in the source model (None: the
    keys of an ``nn.Sequential`` of the units, ``"{unit}.{key}"``)."""
    init_weights: InitWeights | None = None
    """How to initialise a unit built on the meta device (see :data:`InitWeights`)."""
    loss_fn: LossFn | None = None
    """The loss the model trains with, where the model defines one (a causal LM's)."""
    source: dict[str, Any] = field(default_factory=dict)
    """What the export needs to rebuild the source model: for a Hugging Face model
    ``{"library": "transformers", "class": ..., "config": config.to_dict()}``."""

    def __post_init__(self) -> None:
        if not self.units or not all(isinstance(u, nn.Module) for u in self.units):
            raise RuntimeConfigError(
                "ModelUnits takes a non-empty list of nn.Module units "
                f"(got {[type(u).__name__ for u in self.units]})"
            )
        if self.names is None:
            return
        fix = "source_names(model, units) builds them"
        if not isinstance(self.names, list) or len(self.names) != len(self.units):
            count = len(self.names) if isinstance(self.names, list) else type(self.names).__name__
            raise RuntimeConfigError(
                f"ModelUnits has {len(self.units)} units but names {count}; give a list of "
                f"one name map per unit ({fix})"
            )
        for i, (unit, names) in enumerate(zip(self.units, self.names, strict=True)):
            keys = set(unit.state_dict())
            bad = not isinstance(names, dict) or any(
                not isinstance(v, list) or not v or not all(isinstance(n, str) for n in v)
                for v in names.values()
            )
            if bad or set(names) != keys:
                missing = sorted(keys - set(names)) if isinstance(names, dict) else []
                raise RuntimeConfigError(
                    f"the names of unit {i} ({type(unit).__name__}) must map each of its "
                    f"state_dict keys to a non-empty list of the model's names (missing "
                    f"{missing[:4]}, got {type(names).__name__}); {fix}"
                )

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        units: Sequence[nn.Module],
        *,
        init_weights: InitWeights | None = None,
        loss_fn: LossFn | None = None,
        source: dict[str, Any] | None = None,
    ) -> ModelUnits:
        """``units`` (submodules of ``model``), named as ``model`` names their tensors."""
        units = list(units)
        return cls(units, source_names(model, units), init_weights, loss_fn, source or {})

    def unit_names(self, index: int) -> dict[str, list[str]]:
        """Unit ``index``'s keys -> the source model's keys."""
        if self.names is not None:
            return self.names[index]
        return {key: [f"{index}.{key}"] for key in self.units[index].state_dict()}


def unit_labels(layers: object) -> UnitLabels:
    """What ``recompute`` may name each unit by: its key in an ``nn.Sequential`` (else its
    index) and its class."""
    if isinstance(layers, ModelUnits):
        units: list[Any] = list(layers.units)
        names = [str(i) for i in range(len(units))]
    elif isinstance(layers, nn.Sequential):
        units, names = list(layers), list(layers._modules)
    elif isinstance(layers, (list, tuple)):
        units, names = list(layers), [str(i) for i in range(len(layers))]
    else:
        units, names = [], []
    return UnitLabels(tuple(names), tuple(type(u).__name__ for u in units))


def as_model_units(layers: nn.Module | Sequence[nn.Module] | ModelUnits) -> ModelUnits:
    """``Pipeline``'s ``layers`` as units (a ``ModelUnits`` as it is), or the error that says
    what it takes."""
    if isinstance(layers, ModelUnits):
        return layers
    units = list(layers) if isinstance(layers, (nn.Sequential, list, tuple)) else None
    if not units or not all(isinstance(u, nn.Module) for u in units):
        raise RuntimeConfigError(
            f"Pipeline takes an nn.Sequential, a non-empty list of nn.Module units or a "
            f"ModelUnits (got {type(layers).__name__}); a unit takes the previous unit's "
            f"output (a tensor, or a tuple of tensors as its arguments)"
        )
    return ModelUnits(units)
