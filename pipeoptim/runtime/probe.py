"""The dry run: two samples through every stage before any work.

It gives the receiving ranks the shape and dtype of each stage's output (under mixed
precision too), and it turns the commonest user errors into one message naming the stage,
the unit and the shapes, instead of a torch traceback deep inside a pipelined run: layers
that do not chain, a data set with the wrong feature count, targets the loss rejects, a
loss that is not a scalar.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pipeoptim.errors import StageError
from pipeoptim.runtime.diagnose import describe_failure
from pipeoptim.runtime.executor import Boundary
from pipeoptim.runtime.loss import LossFn, checked_loss
from pipeoptim.runtime.precision import AMP_DTYPES

__all__ = ["probe_stages"]


def _device(units: Sequence[nn.Module], default: torch.device) -> torch.device:
    for unit in units:
        for t in unit.parameters():
            return t.device
    return default


def probe_stages(
    units: Sequence[nn.Module],
    bounds: Sequence[tuple[int, int]],
    x: Tensor,
    y: Tensor,
    loss_fn: LossFn,
    amp: str | None,
    device: torch.device,
) -> list[Boundary]:
    """Run ``x`` through the stages (units ``bounds[k]``, each on the device its weights
    are on) and the loss on ``y``; returns each stage's per-sample output shape and dtype.
    Units are in eval mode meanwhile, so batch-norm statistics do not move."""
    modes = [u.training for u in units]
    for u in units:
        u.eval()
    dtype = AMP_DTYPES[amp] if amp else None
    out: list[Boundary] = []
    h = x
    try:
        with torch.no_grad():
            for k, (a, b) in enumerate(bounds):
                stage_units = units[a:b]
                dev = _device(stage_units, device)
                h_in = h = h.to(dev)
                with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                    try:
                        for unit in stage_units:
                            h = unit(h)
                            if not isinstance(h, Tensor):
                                raise TypeError("a unit returned a non-tensor")
                    except Exception as err:
                        message = describe_failure(
                            stage_units, h_in, stage=k, first_unit=a, error=err
                        )
                        raise StageError(message) from err
                    out.append(Boundary(tuple(h.shape[1:]), h.dtype))
                    if k == len(bounds) - 1:
                        checked_loss(loss_fn, h, y.to(dev), "the first batch", k)
    finally:
        for u, mode in zip(units, modes, strict=True):
            u.train(mode)
    return out
