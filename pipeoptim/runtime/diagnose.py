"""Which unit of a stage failed, and why, in words a user can act on.

A stage runs its units as one call, and a torch error from deep inside it names neither the
stage nor the unit. On the error path (never on the hot path) the units are run again one
by one to find the one that fails, and the message names the stage, the unit, the input
shape and what a common layer expects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["describe_failure"]


def _expects(unit: nn.Module) -> str:
    """What a common layer expects of its input, for error messages."""
    if isinstance(unit, nn.Linear):
        return f", expects a last dimension of {unit.in_features}"
    if isinstance(unit, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return f", expects {unit.in_channels} input channels"
    if isinstance(unit, nn.Embedding):
        return f", expects integer ids below {unit.num_embeddings}"
    if isinstance(unit, nn.LayerNorm):
        return f", expects trailing dimensions {tuple(unit.normalized_shape)}"
    return ""


def _shape(x: object) -> str:
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__


def describe_failure(
    units: Sequence[nn.Module], x: Tensor, *, stage: int, first_unit: int, error: BaseException
) -> str:
    """Which unit of a stage fails on ``x`` and why: runs the units one by one (no autograd)
    to find it, since a whole-stage call only says that something failed."""
    h: object = x
    with torch.no_grad():
        for i, unit in enumerate(units):
            if not isinstance(h, Tensor):
                break
            name = f"stage {stage}, unit {first_unit + i} ({type(unit).__name__}"
            try:
                h = unit(h)
            except Exception as err:
                cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
                after = f" (it follows unit {first_unit + i - 1})" if i else ""
                return (
                    f"{name}{_expects(unit)}) rejected its input of shape {_shape(h)}{after}: "
                    f"{type(err).__name__}: {cause}; check the data's shape and the layer sizes"
                )
            if not isinstance(h, Tensor):
                return (
                    f"{name}) returned {type(h).__name__}; every unit of a pipelined model must "
                    f"take one tensor and return one tensor (wrap units that return tuples)"
                )
    return f"stage {stage} failed on an input of shape {_shape(x)}: {type(error).__name__}: {error}"
