"""A stage's split backward (zero-bubble schedules): the input half I, the weight half W.

How: the forward runs the stage's units one by one and keeps the output of each unit that has
weights (:func:`run_units_kept`). The input half (:func:`input_half`) asks autograd for the
gradient of the stage's input and of every such unit output at once
(``torch.autograd.grad(..., retain_graph=True)``): no weight gradient is computed, and the
graph stays. The weight half (:func:`weight_half`) runs, per unit, ``torch.autograd.backward(
unit output, its gradient, inputs=unit weights)``, which walks that unit's part of the graph
only; the caller then drops the graph, so the micro-batch's activations (and the captured
gradients) are held until ``W``. Where the units cannot be told apart (a weight shared by two
units, a container with its own forward or hooks) the stage is one unit: ``W`` then walks the
whole graph for the weights only. No random number is drawn again: both halves reuse the
forward's graph. Synchronous (flush) methods only: no update may come between a forward and
its ``W``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from pipeoptim.errors import StageError
from pipeoptim.plan.methods import WeightPolicy

__all__ = [
    "KeptUnits",
    "WeightHalf",
    "input_half",
    "run_units_kept",
    "split_refusal",
    "unit_params",
    "weight_half",
]

KeptUnits = list[tuple[Tensor, list[Tensor]]]
"""(unit output, its trainable weights) of each weighted unit, kept by a split forward."""
WeightHalf = list[tuple[Tensor, Sequence[Tensor], Tensor]]
"""What a W runs: (root, weights, gradient of the root) per unit, found by its I."""


def split_refusal(name: str, policy: WeightPolicy, half: str | None = None) -> str:
    """The error for a split backward under a policy that updates between F and W."""
    what = f"an {half} (half of a split backward)" if half else "a split backward (I/W)"
    return (
        f"method {name!r} runs {what} under the {policy.name} weight policy; the runtime "
        f"splits backwards only for synchronous (flush) methods, where no update comes "
        f"between a forward and its W: merge each I and W into one B "
        f"(pipeoptim.plan.passes.merge_backward) for this method"
    )


def unit_params(module: nn.Module, params: Sequence[Tensor]) -> list[list[Tensor]] | None:
    """The trainable weights of each unit of ``module``, where a forward may run its units
    one by one with each unit's weights its own: a plain ``nn.Sequential`` without hooks,
    whose every weight belongs to exactly one unit. None otherwise."""
    if type(module).forward is not nn.Sequential.forward:
        return None
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    owner: dict[int, int] = {}
    units: list[list[Tensor]] = []
    for i, unit in enumerate(module._modules.values()):  # as the forward runs them
        if unit is None:
            return None
        mine: list[Tensor] = [p for p in unit.parameters() if p.requires_grad]
        for p in mine:
            if owner.setdefault(id(p), i) != i:
                return None  # shared by two units: one W pass would count it twice
        units.append(mine)
    if set(owner) != {id(p) for p in params}:
        return None
    return units


def run_units_kept(
    module: nn.Sequential,
    x: Tensor,
    units: list[list[Tensor]],
    *,
    stage: int,
    failure: Callable[[Tensor, Exception], str],
) -> tuple[Tensor, KeptUnits | None]:
    """The units of ``module`` on ``x`` one by one (what ``nn.Sequential`` does), keeping the
    output of each unit with weights; None in place of the kept outputs where two units hand
    on the same tensor (an in-place unit with weights). ``failure`` words a unit's error."""
    kept: KeptUnits | None = []
    seen = {id(x)}
    h = x
    try:
        for unit, params in zip(module, units, strict=True):
            h = unit(h)
            if not params or not isinstance(h, Tensor) or not h.requires_grad:
                continue
            if kept is not None and id(h) not in seen:
                seen.add(id(h))
                kept.append((h, params))
            else:
                kept = None
    except Exception as err:
        raise StageError(failure(x, err)) from err
    if not isinstance(h, Tensor):
        raise StageError(f"stage {stage}: the last unit returned {type(h).__name__}, not a tensor")
    return h, kept


def input_half(
    root: Tensor,
    root_grad: Tensor | None,
    x_in: Tensor,
    units: KeptUnits | None,
    params: Sequence[Tensor],
) -> tuple[Tensor | None, WeightHalf]:
    """The I of one micro-batch: the gradient of its input (None where the input needs
    none) and what its W is to run. The caller runs it under the stage's RNG stream."""
    half: WeightHalf = []
    g_in: Tensor | None = None
    wants_input = x_in.requires_grad
    targets = [x_in] if wants_input else []
    if units is not None:
        targets += [t for t, _ in units]
    elif params:  # one unit: W walks the whole graph for the weights only
        half.append((root, params, torch.ones_like(root) if root_grad is None else root_grad))
    if targets:
        found = torch.autograd.grad(root, targets, root_grad, retain_graph=True, allow_unused=True)
        if wants_input:
            g_in, found = found[0], found[1:]
        for (t, weights), g in zip(units or [], found, strict=True):
            if g is not None:
                half.append((t, weights, g))
    return g_in, half


def weight_half(half: WeightHalf) -> None:
    """The W of one micro-batch: its weight gradients accumulate into ``.grad``."""
    for root, params, g in half:
        # inputs=: autograd walks only what leads to these weights (this unit).
        torch.autograd.backward(root, g, inputs=params, retain_graph=True)
