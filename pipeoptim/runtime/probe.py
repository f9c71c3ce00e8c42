"""The dry run: two samples through every stage before any work.

It gives the receiving ranks the shape and dtype of each stage's output (under mixed
precision too), and it turns the commonest user errors into one message naming the stage,
the unit and the shapes, instead of a torch traceback deep inside a pipelined run: layers
that do not chain, a data set with the wrong feature count, targets the loss rejects, a
loss that is not a scalar. Before training it also refuses what cannot train: a model with
no trainable parameter at all, and a loss that gives the model's output no gradient
(detached, a constant, computed through argmax, or an integer output). The pipeline would
run to the end with every weight unchanged (a stage's backward skips an output that does
not require grad), where plain torch raises at ``loss.backward()``. A stage without
parameters (a lone ReLU) and frozen parameters on some stages stay legal.

The units run under ``torch.no_grad`` all the same (a module may count its forwards in grad
mode as training ones): only the loss runs with grad, on a copy of the output that requires
it. So a unit that cuts the graph inside the model (a ``.detach()`` in a forward) is not
seen here.
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
    *,
    training: bool = False,
) -> list[Boundary]:
    """Run ``x`` through the stages (units ``bounds[k]``, each on the device its weights
    are on) and the loss on ``y``; returns each stage's per-sample output shape and dtype.
    Units are in eval mode meanwhile, so batch-norm statistics do not move. ``training``:
    the run will train, so what cannot train is refused (:func:`_check_trains`)."""
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
                        if training:
                            _check_trains(units, k, loss_fn, h, y.to(dev))
                        else:
                            checked_loss(loss_fn, h, y.to(dev), "the first batch", k)
    finally:
        for u, mode in zip(units, modes, strict=True):
            u.train(mode)
    return out


def _check_trains(
    units: Sequence[nn.Module], last: int, loss_fn: LossFn, out: Tensor, target: Tensor
) -> None:
    """Refuse a run that cannot train: no trainable parameter in the whole model, or a loss
    that gives the model's output no gradient (computed here with grad on a copy of the
    output that requires it; the units are not re-run)."""
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    where = f"stage {last} (the last): the loss {name}"
    params = [p for u in units for p in u.parameters()]
    if not any(p.requires_grad for p in params):
        what = f"all {len(params)} of its parameters are frozen" if params else "it has none"
        raise StageError(
            f"{where} depends on no trainable parameter: the model has no trainable parameter "
            f"({what}), so training would change no weight; unfreeze some "
            f"(requires_grad=True), or use evaluate() alone"
        )
    if not (out.is_floating_point() or out.is_complex()):
        checked_loss(loss_fn, out, target, "the first batch", last)  # its own errors first
        raise StageError(
            f"{where} gets no gradient: the model's output is {out.dtype}, which cannot carry "
            f"one (an argmax or rounding in the last unit?), so training would change no "
            f"weight; end the model with the scores (e.g. the logits) and compute the "
            f"prediction from them outside the model"
        )
    with torch.enable_grad():
        leaf = out.detach().requires_grad_(True)
        loss = checked_loss(loss_fn, leaf, target, "the first batch", last)
    if not loss.requires_grad:
        raise StageError(
            f"{where} returned a tensor that does not require grad, so no trainable parameter "
            f"gets a gradient and training would change no weight; compute the loss from the "
            f"output with differentiable operations (e.g. F.cross_entropy(output, target)), "
            f"without .detach(), .item(), argmax, a constant or torch.no_grad()"
        )
