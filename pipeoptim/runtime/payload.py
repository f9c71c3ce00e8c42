"""What a unit hands the next one, and a stage the next stage: one tensor, or a tuple of them.

As in torchgpipe, a unit may return a tuple of tensors (hidden states and a mask, say), which
the next unit takes as its positional arguments (``unit(*h)``), within a stage
(:class:`~pipeoptim.runtime.stage.chain.UnitChain`) and across a stage boundary alike. A single
tensor is the common case and keeps its own code paths everywhere (the hot path branches
only where a payload is a tuple); the helpers here are for the tuple branches, the data
path and the error path. Gradients flow back through the floating-point tensors of a tuple
only; integer and boolean ones (masks, ids) travel forward and take none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias

import torch
from torch import Tensor

from pipeoptim.errors import StageError
from pipeoptim.runtime.boundary import shape_fits
from pipeoptim.runtime.stage.loss import (
    LossFn,
    checked_loss,
    checked_scalar,
    nothing_counted_is_zero,
)

__all__ = [
    "MAX_PARTS",
    "Gradients",
    "Payload",
    "batch_len",
    "boundary_mismatch",
    "boundary_refusal",
    "checked_payload_loss",
    "checked_tuple",
    "describe",
    "detached",
    "head",
    "input_gradients",
    "output_problem",
    "output_roots",
    "payload_bytes",
    "split",
    "to_device",
]

Payload: TypeAlias = Tensor | tuple[Tensor, ...]
"""One tensor, or a tuple of tensors (a unit's positional arguments)."""
Gradients: TypeAlias = Tensor | tuple[Tensor | None, ...]
"""The gradient of a payload: a tensor, or per tensor of a tuple (None: not floating point)."""

MAX_PARTS = 64
"""The most tensors one tuple may carry across a stage boundary (the message tags give each
part its own range)."""


def describe(x: object) -> str:
    """``x``'s shape and dtype in words: ``(4, 8) torch.float32``, or each tensor of a tuple."""
    if isinstance(x, Tensor):
        return f"{tuple(x.shape)} {x.dtype}"
    if isinstance(x, tuple):
        inner = ", ".join(describe(t) if isinstance(t, Tensor) else type(t).__name__ for t in x)
        tensors = " tensors" if all(isinstance(t, Tensor) for t in x) else ""
        return f"a tuple of {len(x)}{tensors}: {inner}"
    return type(x).__name__


class Spec(Protocol):
    """One tensor of a stage boundary, per sample (``executor.TensorSpec``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


def _shape_words(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{tuple(shape)} {dtype}"


def boundary_mismatch(
    out: Payload, spec: Spec | tuple[Spec, ...], n: int
) -> tuple[str, str] | None:
    """Where ``out`` differs from the boundary the dry run found (``spec``, per sample) for
    ``n`` samples: (what ``out`` is, what the dry run gave), in words; None where it
    matches. The receiving rank allocates ``spec`` before the message arrives, so a tensor
    whose shape depends on the data could not travel."""
    if isinstance(out, Tensor):
        if (
            not isinstance(spec, tuple)
            and out.dim() > 0
            and out.shape[0] == n
            and shape_fits(tuple(out.shape[1:]), spec.shape)
            and out.dtype == spec.dtype
        ):
            return None
    elif (
        isinstance(spec, tuple)
        and len(out) == len(spec)
        and all(
            t.dim() > 0
            and t.shape[0] == n
            and shape_fits(tuple(t.shape[1:]), p.shape)
            and t.dtype == p.dtype
            for t, p in zip(out, spec, strict=True)
        )
    ):
        return None
    parts = (out,) if isinstance(out, Tensor) else out
    batches = sorted({int(t.shape[0]) for t in parts if t.dim() > 0})
    samples = f" for {batches[0]} samples" if batches and batches != [n] else ""
    if isinstance(out, Tensor):
        got = f"a tensor of per-sample shape {_shape_words(out.shape[1:], out.dtype)}{samples}"
    else:
        inner = ", ".join(_shape_words(t.shape[1:], t.dtype) for t in out)
        got = f"a tuple of {len(out)} tensors (per sample {inner}){samples}"
    if isinstance(spec, tuple):
        inner = ", ".join(_shape_words(p.shape, p.dtype) for p in spec)
        want = f"a tuple of {len(spec)} (per sample {inner})"
    else:
        want = _shape_words(spec.shape, spec.dtype)
    if samples:
        want += f" for the micro-batch's {n} samples"
    return got, want


def boundary_refusal(stage: Any, where: str, got: str, want: str) -> str:
    """The refusal of a :func:`boundary_mismatch` of ``stage`` (a ``Stage``) at ``where``."""
    unit = stage.first_unit + len(stage.module) - 1
    name = type(stage.module[-1]).__name__
    return (
        f"stage {stage.index}, unit {unit} ({name}) hands the next stage {got} at {where}, "
        f"where the dry run gave {want}: what crosses a stage boundary keeps the shape "
        f"the first batch gave it, since the receiving rank allocates that before the "
        f"message arrives (across processes a changed shape would arrive cut short or "
        f"padded with garbage), in one process as in many; where batches vary in length "
        f"(a collate that pads each batch to its longest sequence), turn varying shapes on "
        f"(Pipeline(..., varying_shapes=True), CommOptions.varying_shapes), so each message "
        f"carries its shape; otherwise pad every batch to one length or keep the "
        f"shape-changing units within one stage"
    )


def output_problem(h: object) -> str | None:
    """What makes ``h`` unfit to hand on (None: a tensor, or a non-empty tuple of tensors)."""
    if isinstance(h, Tensor):
        return None
    if not isinstance(h, tuple):
        return (
            f"returned {type(h).__name__}; a unit returns one tensor or a tuple of tensors "
            f"(the next unit's positional arguments)"
        )
    if not h:
        return "returned an empty tuple; return one tensor or a tuple of tensors"
    for i, t in enumerate(h):
        if not isinstance(t, Tensor):
            return (
                f"returned a tuple whose item {i} is {type(t).__name__} ({t!r:.40}), not a "
                f"tensor; every item of a tuple a unit hands on must be a tensor (make a "
                f"flag or a length a tensor, and leave out what is None)"
            )
    return None


def batch_len(x: Payload) -> int:
    """Samples in a batch: the length of its (first) tensor."""
    return len(x) if isinstance(x, Tensor) else len(x[0])


def head(x: Payload, n: int) -> Payload:
    """The first ``n`` samples of every tensor."""
    return x[:n] if isinstance(x, Tensor) else tuple(t[:n] for t in x)


def to_device(x: Payload, device: torch.device) -> Payload:
    if isinstance(x, Tensor):
        return x.to(device, non_blocking=True)
    return tuple(t.to(device, non_blocking=True) for t in x)


def split(x: Payload, parts: int) -> list[Payload]:
    """``x`` in ``parts`` consecutive pieces along the batch (``tensor_split``)."""
    if isinstance(x, Tensor):
        return list(x.tensor_split(parts))
    pieces = [t.tensor_split(parts) for t in x]
    return [tuple(p[i] for p in pieces) for i in range(parts)]


def detached(x: Payload) -> Payload:
    return x.detach() if isinstance(x, Tensor) else tuple(t.detach() for t in x)


def payload_bytes(x: Tensor | Sequence[Tensor | None]) -> int:
    """Bytes of a tensor or of the tensors of a tuple (None counts 0)."""
    if isinstance(x, Tensor):
        return x.numel() * x.element_size()
    return sum(t.numel() * t.element_size() for t in x if t is not None)


def checked_payload_loss(
    loss_fn: LossFn, out: Payload, target: Tensor, where: str, stage: int
) -> Tensor:
    """``loss_fn(out, target)`` (:func:`~pipeoptim.runtime.stage.loss.checked_loss`); a tuple
    output is passed as it is, and an error names each of its tensors."""
    if isinstance(out, Tensor):
        return checked_loss(loss_fn, out, target, where, stage)
    try:
        loss = loss_fn(out, target)  # type: ignore[arg-type]
    except Exception as err:
        raise StageError(
            f"stage {stage} (the last): the loss failed on {where}: {type(err).__name__}: "
            f"{err} (output {describe(out)}, targets shape {tuple(target.shape)} "
            f"{target.dtype}); the last unit returns a tuple, which the loss is given as it "
            f"is: loss_fn(output_tuple, target)"
        ) from err
    return nothing_counted_is_zero(checked_scalar(loss), target)


def checked_tuple(out: tuple[Any, ...], stage: int, unit: int, name: str) -> tuple[Tensor, ...]:
    """A tuple a non-last stage hands on, refused (naming the stage and its last unit) where
    it holds a non-tensor."""
    problem = output_problem(out)
    if problem is not None:
        raise StageError(f"stage {stage}, unit {unit} ({name}) {problem}")
    return out


def output_roots(
    out: tuple[Tensor, ...],
    grad: Gradients | None,
    scaled: Callable[[Tensor], Tensor],
    stage: int,
) -> tuple[list[Tensor], list[Tensor]]:
    """The tensors of a tuple output that take a gradient, and theirs (``scaled`` for the
    loss scale): ``grad`` has one per floating-point tensor (None in its other places, or
    left out)."""
    if grad is None:
        return [], []
    given = [grad] if isinstance(grad, Tensor) else [g for g in grad if g is not None]
    floats = [t for t in out if t.is_floating_point()]
    if len(given) != len(floats):
        raise RuntimeError(
            f"stage {stage}: {len(given)} gradients for the {len(floats)} floating-point "
            f"tensors of its output"
        )
    pairs = [(t, g) for t, g in zip(floats, given, strict=True) if t.requires_grad]
    return [t for t, _ in pairs], [scaled(g) for _, g in pairs]


def input_gradients(
    x_in: tuple[Tensor, ...],
    found: Sequence[Tensor | None],
    true_gradient: Callable[[Tensor | None], Tensor | None],
) -> tuple[Tensor | None, ...]:
    """A tuple input's gradient as sent upstream: per floating-point tensor (zeros where it
    got none, unscaled by ``true_gradient``), None for the others."""
    return tuple(
        (true_gradient(g) if g is not None else torch.zeros_like(t))
        if t.is_floating_point()
        else None
        for t, g in zip(x_in, found, strict=True)
    )
