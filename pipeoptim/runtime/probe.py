"""The dry run: two samples through every stage before any work.

It gives the receiving ranks the shape and dtype of each stage's output (under mixed
precision too; for a stage that hands on a tuple, of each of its tensors), and it turns the
commonest user errors into one message naming the stage, the unit and the shapes, instead
of a torch traceback deep inside a pipelined run: layers that do not chain, a data set with
the wrong feature count, a unit that returns a tuple to a unit of one argument (or one
tensor to a unit of several), a tuple holding something else than tensors, a tensor crossing
a stage boundary without the batch dimension first, targets the loss rejects, a loss that is
not a scalar. Before training it also refuses what cannot train: a model with
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
from pipeoptim.runtime.boundary import MappingSpec
from pipeoptim.runtime.executor import Boundary, TensorSpec
from pipeoptim.runtime.payload import (
    MAX_PARTS,
    Payload,
    batch_len,
    checked_payload_loss,
    describe,
    mapped,
    output_problem,
    parts,
    rebuilt,
    to_device,
)
from pipeoptim.runtime.stage.diagnose import describe_failure
from pipeoptim.runtime.stage.loss import LossFn
from pipeoptim.runtime.stage.precision import AMP_DTYPES

__all__ = ["probe_stage", "probe_stages", "stand_in"]


def _device(units: Sequence[nn.Module], default: torch.device) -> torch.device:
    for unit in units:
        for t in unit.parameters():
            return t.device
    return default


def probe_stages(
    units: Sequence[nn.Module],
    bounds: Sequence[tuple[int, int]],
    x: Payload,
    y: Tensor,
    loss_fn: LossFn,
    amp: str | None,
    device: torch.device,
    *,
    training: bool = False,
) -> list[Boundary]:
    """Run ``x`` through the stages (units ``bounds[k]``, each on the device its weights
    are on) and the loss on ``y``; returns each stage's per-sample output shape and dtype
    (per tensor, where a stage hands on a tuple).
    Units are in eval mode meanwhile, so batch-norm statistics do not move. ``training``:
    the run will train, so what cannot train is refused (:func:`_check_trains`)."""
    out: list[Boundary] = []
    h: Payload = x
    n = batch_len(x)
    for k in range(len(bounds)):
        spec, h = probe_stage(units, bounds, k, h, n, y, loss_fn, amp, device, training=training)
        out.append(spec)
    return out


def probe_stage(
    units: Sequence[nn.Module],
    bounds: Sequence[tuple[int, int]],
    k: int,
    x: Payload,
    n: int,
    y: Tensor,
    loss_fn: LossFn,
    amp: str | None,
    device: torch.device,
    *,
    training: bool = False,
) -> tuple[Boundary, Payload]:
    """Stage ``k``'s part of :func:`probe_stages`: its output spec and its output (on the
    last stage, with the loss checked on ``y``)."""
    a, b = bounds[k]
    stage_units = units[a:b]
    modes = [u.training for u in stage_units]
    for u in stage_units:
        u.eval()
    dtype = AMP_DTYPES[amp] if amp else None
    dev = _device(stage_units, device)
    try:
        with torch.no_grad():
            h_in = h = to_device(x, dev)
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                try:
                    for unit in stage_units:
                        h = unit(*h) if isinstance(h, tuple) else unit(h)
                        problem = output_problem(h)
                        if problem is not None:
                            raise TypeError(problem)
                except Exception as err:
                    message = describe_failure(stage_units, h_in, stage=k, first_unit=a, error=err)
                    raise StageError(message) from err
                last = k == len(bounds) - 1
                spec = _boundary(h, n, k, b - 1, stage_units[-1], check=not last)
                if last:
                    if training:
                        _check_trains(units, k, loss_fn, h, y.to(dev))
                    else:
                        checked_payload_loss(loss_fn, h, y.to(dev), "the first batch", k)
    finally:
        for u, mode in zip(stage_units, modes, strict=True):
            u.train(mode)
    return spec, h


def stand_in(spec: Boundary, n: int, device: torch.device) -> Payload:
    """Zeros of ``spec``'s shapes for ``n`` samples: a stage's input for a dry run on a rank
    that does not hold the stage before it (a model built on the meta device). Zeros are a
    valid index for an id input too."""
    if isinstance(spec, TensorSpec):
        return torch.zeros((n, *spec.shape), dtype=spec.dtype, device=device)
    if isinstance(spec, MappingSpec):
        zeros = [torch.zeros((n, *t.shape), dtype=t.dtype, device=device) for t in spec.parts]
        return rebuilt(spec.keys, [v is not None for v in spec.values], zeros)
    return tuple(torch.zeros((n, *t.shape), dtype=t.dtype, device=device) for t in spec)


def _boundary(
    h: Payload, n: int, stage: int, unit: int, module: nn.Module, *, check: bool
) -> Boundary:
    """What stage ``stage`` hands on, per sample; ``check``: refuse a tensor that does not
    have the batch dimension first (the receiving ranks allocate micro-batch x per sample)."""
    if isinstance(h, Tensor) and not check:
        return TensorSpec(tuple(h.shape[1:]), h.dtype)
    tensors = parts(h)
    if check and len(tensors) > MAX_PARTS:
        raise StageError(
            f"stage {stage}, unit {unit} ({type(module).__name__}) hands the next stage a "
            f"{type(h).__name__} of {len(tensors)} tensors, over the {MAX_PARTS} a stage "
            f"boundary carries; stack tensors of one shape into one"
        )
    names = [k for k, v in h.items() if v is not None] if isinstance(h, dict) else None
    for i, t in enumerate(tensors):
        if check and (t.dim() == 0 or t.shape[0] != n):
            which = (
                f"{describe(h)}; its tensor {i if names is None else repr(names[i])}, of "
                f"shape {tuple(t.shape)},"
                if not isinstance(h, Tensor)
                else f"a tensor of shape {tuple(t.shape)}, which"
            )
            raise StageError(
                f"stage {stage}, unit {unit} ({type(module).__name__}) hands the next stage "
                f"{which} does not have the batch dimension first (the dry run's {n} "
                f"samples); every tensor that crosses a stage boundary has the batch first, "
                f"with the micro-batch's size, since the receiving rank allocates micro-batch "
                f"x per-sample shape: expand a tensor all samples share (a mask) to the "
                f"batch, e.g. mask.expand(batch, *mask.shape)"
            )
    if isinstance(h, Tensor):
        return TensorSpec(tuple(h.shape[1:]), h.dtype)
    if isinstance(h, dict):
        values = tuple(
            None if t is None else TensorSpec(tuple(t.shape[1:]), t.dtype) for t in h.values()
        )
        return MappingSpec(tuple(h), values)
    return tuple(TensorSpec(tuple(t.shape[1:]), t.dtype) for t in h)


def _check_trains(
    units: Sequence[nn.Module], last: int, loss_fn: LossFn, out: Payload, target: Tensor
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
    if not any(t.is_floating_point() or t.is_complex() for t in parts(out)):
        checked_payload_loss(loss_fn, out, target, "the first batch", last)  # its errors first
        what = str(out.dtype) if isinstance(out, Tensor) else f"{describe(out)}, no float in it"
        raise StageError(
            f"{where} gets no gradient: the model's output is {what}, which cannot carry "
            f"one (an argmax or rounding in the last unit?), so training would change no "
            f"weight; end the model with the scores (e.g. the logits) and compute the "
            f"prediction from them outside the model"
        )
    with torch.enable_grad():
        leaf: Payload
        if isinstance(out, Tensor):
            leaf = out.detach().requires_grad_(True)
        else:
            leaf = mapped(
                out,
                lambda t: (
                    t.detach().requires_grad_(True)
                    if t.is_floating_point() or t.is_complex()
                    else t
                ),
            )
        loss = checked_payload_loss(loss_fn, leaf, target, "the first batch", last)
    if not loss.requires_grad:
        raise StageError(
            f"{where} returned a tensor that does not require grad, so no trainable parameter "
            f"gets a gradient and training would change no weight; compute the loss from the "
            f"output with differentiable operations (e.g. F.cross_entropy(output, target)), "
            f"without .detach(), .item(), argmax, a constant or torch.no_grad()"
        )
