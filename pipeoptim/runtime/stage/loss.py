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
    "counted_targets",
    "evaluation_weight",
    "nothing_counted_is_zero",
    "token_share",
]

LossFn = Callable[[Tensor, Tensor], Tensor]
"""(output of the last stage, targets) -> scalar loss: the mean over the micro-batch's counted
targets (integer targets equal to :data:`IGNORE_INDEX` are not counted, as
``F.cross_entropy``'s default ``reduction="mean"`` does), or for other targets the mean over
the micro-batch. See :func:`token_share` for how micro-batches add up."""

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


def token_targets(target: Tensor) -> bool:
    """Whether ``target`` holds token ids (integer class targets), of which those equal to
    :data:`IGNORE_INDEX` are ignored; float and bool targets are values, all counted."""
    return not (target.is_floating_point() or target.dtype == torch.bool)


def counted_targets(target: Tensor) -> Tensor:
    """The targets a token-mean loss counts (those not :data:`IGNORE_INDEX`; every target
    where the targets are not token ids), as a one-element int64 tensor where ``target``
    is. No host sync."""
    if not token_targets(target):
        return torch.full((1,), target.numel(), dtype=torch.int64, device=target.device)
    return (target != IGNORE_INDEX).sum(dtype=torch.int64).reshape(1)


def token_share(
    loss: Tensor,
    target: Tensor,
    micro_batches: int,
    counted: Tensor | int | None,
    replicas: int = 1,
) -> Tensor:
    """A micro-batch's ``loss`` (its mean over its counted targets) as its share of the
    mini-batch's token mean: ``loss x its counted targets / the mini-batch's``, so that the
    M micro-batches' shares add up to (sum of token losses) / (counted targets), M = 1's
    loss, and their gradients to its gradient. ``counted``: the whole mini-batch's counted
    targets over its ``replicas`` data-parallel shares (each replica's gradient is then
    the replicas' mean: the share is scaled by D). Where nothing is ignored (or the targets
    are not token ids, or ``counted`` is None) every share is 1/M and the loss is divided
    by M exactly as the mean of micro-batch means always was, bit for bit. On the device:
    no host sync; a count known on the host (an int: the batch was counted where it was
    read, in this process) decides there, at no cost where nothing is ignored."""
    mean_of_means = loss / micro_batches
    if counted is None or not token_targets(target) or target.numel() == 0:
        return mean_of_means
    full = target.numel() * micro_batches * replicas
    if isinstance(counted, int):
        if counted == full:
            return mean_of_means
        mine = (target != IGNORE_INDEX).sum()
        return (loss.float() * (mine * (replicas / max(counted, 1)))).to(loss.dtype)
    total = counted.reshape(()).to(loss.device)
    mine = (target != IGNORE_INDEX).sum(dtype=torch.int64)
    weight = (mine * replicas).float() / total.clamp(min=1).float()
    weighted = (loss.float() * weight).to(loss.dtype)
    nothing_ignored = total == full
    return torch.where(nothing_ignored, mean_of_means, weighted)


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
