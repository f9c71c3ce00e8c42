"""The last stage's loss and accuracy count, checked so that a bad loss names its values.

Apart from the stage because the dry run (``probe``) calls the same check before any stage
exists, and evaluation counts correct predictions the same way as training.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pipeoptim.errors import StageError

__all__ = [
    "IGNORE_INDEX",
    "LossFn",
    "checked_loss",
    "count_correct",
    "evaluation_weight",
    "nothing_counted_is_zero",
]

LossFn = Callable[[Tensor, Tensor], Tensor]
"""(output of the last stage, targets) -> scalar loss (the mean over the micro-batch)."""

IGNORE_INDEX = -100
"""The target id a token-mean loss skips: ``F.cross_entropy``'s and ``F.nll_loss``'s default
``ignore_index``, Hugging Face's and ``pipeoptim.hf.causal_lm_loss``'s."""


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
    return nothing_counted_is_zero(checked_scalar(loss), target)


def nothing_counted_is_zero(loss: Tensor, target: Tensor) -> Tensor:
    """``loss``, or 0 where every target is ignored (integer targets all
    :data:`IGNORE_INDEX`): a token-mean loss is then 0/0, NaN, for a micro-batch (or an
    evaluation batch) that counts no token. That micro-batch contributes 0 to the
    mini-batch's loss and nothing to the gradient (``torch.where`` passes the NaN branch a
    zero gradient, and the loss's backward gives ignored targets none), the way it would
    count in the mini-batch's own token mean. Computed on the device, no host sync; where a
    target is counted the loss is returned bit for bit."""
    if target.is_floating_point() or target.dtype == torch.bool or target.numel() == 0:
        return loss
    counted = (target != IGNORE_INDEX).any()
    return torch.where(counted, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def evaluation_weight(target: Tensor, samples: int) -> Tensor | int:
    """What an evaluation batch's loss (its mean over its counted targets) weighs in the mean
    over the data: its counted targets per target position of a sample, so that the
    evaluation loss is the token mean over all the data (sum of token losses / non-ignored
    targets), a batch of only ignored targets weighing 0. Where nothing is ignored that is
    the batch's sample count exactly (the mean over samples, bit for bit as before); float
    targets weigh their samples. On the device: no host sync."""
    if target.is_floating_point() or target.dtype == torch.bool or target.numel() == 0:
        return samples
    per_sample = max(1, target.numel() // max(1, samples))
    counted = (target != IGNORE_INDEX).sum(dtype=torch.float64) / per_sample
    return counted.float()


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
