"""The last stage's loss and accuracy count, checked so that a bad loss names its values.

Apart from the stage because the dry run (``probe``) calls the same check before any stage
exists, and evaluation counts correct predictions the same way as training.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pipeoptim.errors import StageError

__all__ = ["LossFn", "checked_loss", "count_correct"]

LossFn = Callable[[Tensor, Tensor], Tensor]
"""(output of the last stage, targets) -> scalar loss (the mean over the micro-batch)."""


def checked_loss(loss_fn: LossFn, out: Tensor, target: Tensor, where: str, stage: int) -> Tensor:
    """``loss_fn(out, target)``, checked to be a scalar; errors name the stage and values."""
    try:
        loss = loss_fn(out, target)
    except Exception as err:
        raise StageError(
            f"stage {stage} (the last): the loss failed on {where}: {type(err).__name__}: "
            f"{err} (output shape {tuple(out.shape)} {out.dtype}, targets shape "
            f"{tuple(target.shape)} {target.dtype}{_target_range(target)}); check the targets "
            f"and the loss function"
        ) from err
    return checked_scalar(loss)


def checked_scalar(loss: object) -> Tensor:
    """``loss`` as returned by a loss function, refused unless it is a scalar tensor."""
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise StageError(
            f"the loss function returned {shape}, not a scalar tensor; reduce it (e.g. "
            f"reduction='mean' or .mean()) so every micro-batch gives one number"
        )
    return loss


def count_correct(out: Tensor, target: Tensor) -> Tensor | None:
    """Correct argmax predictions, where the output is a score per class of each target
    (None: not a classifier's output). Stays on the device: nothing is read back."""
    if target.is_floating_point() or out.dim() != target.dim() + 1:
        return None
    if out.shape[:-1] != target.shape:
        return None
    with torch.no_grad():
        return (out.argmax(dim=-1) == target).sum()


def _target_range(target: Tensor) -> str:
    if target.is_floating_point() or target.numel() == 0:
        return ""
    return f", values {int(target.min())}..{int(target.max())}"
