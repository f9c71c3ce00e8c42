"""What a torch-side optimizer family declares: the optimizer it builds, the options it adds,
the predictor that reads its state and, where its state is no multiple of the weights, how
the shapes give it.

Why one record per family: the builder (``update.make_optimizer``), the predictor choice
(``predict.predictor_for``), ZeRO sharding (``sharded.SHARDABLE``) and the profiler each ask
the family a question here instead of keeping a table keyed by its name. What the planner also
needs (default learning rate, state size, whether the step cost follows the shapes) is read
from the torch-free entry the family names (``pipeoptim.plan.optimizer_families``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from pipeoptim.plan.optimizer_families import OptimizerFamily
from pipeoptim.runtime.optim.predictors.base import WeightPredictor

__all__ = ["BETA_OPTIONS", "ShapedStateBytes", "TorchOptimizerFamily", "fold_betas"]

BETA_OPTIONS = ("beta1", "beta2")
"""Options a plan may give one at a time for the ``betas`` pair of Adam's kin (a plan's
options are numbers and booleans: AsyncPP's NAdam is ``{"beta1": 0.99}``)."""

ShapedStateBytes = Callable[[tuple[int, ...], int], int]
"""Bytes of the state kept for one parameter of a shape and element size."""


@dataclass(frozen=True)
class TorchOptimizerFamily:
    """One optimizer family on the torch side."""

    table: OptimizerFamily
    """Its torch-free entry, looked up by name, which holds what the planner knows of it."""
    optimizer_class: type[Optimizer] | None
    """The torch optimizer ``--optimizer NAME`` builds (None: the user's factory builds it)."""
    predictor: type[WeightPredictor]
    """The prediction rule that reads its optimizer's state (``predict.predictor_for``)."""
    default_options: Mapping[str, float | bool] = field(default_factory=dict)
    """Constructor options it adds unless the plan gives them (SGD's momentum 0.9)."""
    also_predicts: Mapping[type[Optimizer], type[WeightPredictor]] = field(default_factory=dict)
    """Other optimizer classes (exact types) whose state its rule reads (torch.optim.Muon)."""
    shaped_state_bytes: ShapedStateBytes | None = None
    """The state bytes of one parameter from its shape, where the state is no fixed
    multiple of the weights (``table.state_from_shapes``)."""
    steps_each_parameter_alone: bool = True
    """Whether its step updates each parameter from its own gradient and state only, so
    ZeRO may shard its state by whole parameters (``sharded.SHARDABLE``)."""

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def default_lr(self) -> float:
        return self.table.default_lr

    @property
    def shaped_step(self) -> bool:
        return self.table.shaped_step

    @property
    def state_from_shapes(self) -> bool:
        return self.table.state_from_shapes

    def state_factor(self, *, momentum: bool | None = None) -> int:
        return self.table.state_factor(momentum=momentum)

    def predicted_classes(self) -> dict[type[Optimizer], type[WeightPredictor]]:
        """Every optimizer class (exact type) whose state this family's rules read."""
        own = {} if self.optimizer_class is None else {self.optimizer_class: self.predictor}
        return {**own, **self.also_predicts}

    def build(self, params: Iterable[Tensor], lr: float, options: Mapping[str, Any]) -> Optimizer:
        """Its optimizer over ``params``, the family's default options under ``options``;
        the constructor's own TypeError or ValueError reaches the caller, who names the fix."""
        if self.optimizer_class is None:
            raise TypeError(
                f"the {self.name!r} family builds no optimizer of its own: pass an optimizer "
                f"factory, e.g. optimizer=lambda params: torch.optim.Adagrad(params, lr=0.01)"
            )
        kwargs: dict[str, Any] = {"lr": lr, **self.default_options, **options}
        return self.optimizer_class(list(params), **fold_betas(self.optimizer_class, kwargs))


def fold_betas(optimizer_class: type[Optimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``beta1`` / ``beta2`` folded into the ``betas`` pair that
    ``optimizer_class`` takes (each missing one is the constructor's default); a TypeError
    that says why where the class takes no such pair, or ``betas`` is given too."""
    given = {k: kwargs[k] for k in BETA_OPTIONS if k in kwargs}
    rest = {k: v for k, v in kwargs.items() if k not in BETA_OPTIONS}
    if not given:
        return rest
    name = optimizer_class.__name__
    parameter = inspect.signature(optimizer_class).parameters.get("betas")
    if parameter is None or not isinstance(parameter.default, tuple):
        raise TypeError(
            f"{name} takes no betas pair, so {', '.join(given)} cannot be set: beta1 and "
            f"beta2 are options of Adam's kin (adam, adamw, nadam); drop them"
        )
    if "betas" in rest:
        raise TypeError(f"give {name} either betas or {', '.join(given)}, not both")
    beta1, beta2 = (float(b) for b in parameter.default)
    betas = (float(given.get("beta1", beta1)), float(given.get("beta2", beta2)))
    return {**rest, "betas": betas}
