"""What a unit hands the next one, and a stage the next stage: a tensor, a tuple or a dict.

As in torchgpipe, a unit may return a tuple of tensors (hidden states and a mask, say), which
the next unit takes as its positional arguments (``unit(*h)``), within a stage
(:class:`~pipeoptim.runtime.stage.chain.UnitChain`) and across a stage boundary alike. A single
tensor is the common case and keeps its own code paths everywhere (the hot path branches
only where a payload is a tuple); the helpers here are for the tuple branches, the data
path and the error path. Gradients flow back through the floating-point tensors of a tuple
only; integer and boolean ones (masks, ids) travel forward and take none.

A unit may also take and return a dict of tensors (``{"hidden": h, "attention_mask": m}``),
given to the next unit as one argument (``unit(h)``, as a tensor is). Across a stage
boundary it travels as its tensors in the key order the dry run saw (:func:`parts`), a
None value as nothing, and the receiving rank rebuilds it from the keys the dry run shared
(:func:`rebuilt`); its gradient is that of a tuple of those tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import torch
from torch import Tensor

from pipeoptim.errors import StageError
from pipeoptim.runtime.boundary import MappingSpec, shape_fits
from pipeoptim.runtime.stage.loss import (
    LossFn,
    checked_loss,
    checked_scalar,
    nothing_counted_is_zero,
)

__all__ = [
    "MAX_PARTS",
    "Gradients",
    "Message",
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
    "mapped",
    "output_problem",
    "output_roots",
    "parts",
    "payload_bytes",
    "rebuilt",
    "split",
    "to_device",
]

Payload: TypeAlias = Tensor | tuple[Tensor, ...] | dict[str, Tensor | None]
"""One tensor, a tuple of tensors (a unit's positional arguments), or a dict of tensors and
None (a unit's one argument)."""
Message: TypeAlias = Tensor | tuple[Tensor, ...]
"""What a transport carries: one tensor, or the parts of a tuple or dict (:func:`parts`)."""
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
    if isinstance(x, Mapping):
        inner = ", ".join(f"{k!r}: {describe(v) if v is not None else None}" for k, v in x.items())
        return f"a dict {{{inner}}}"
    return type(x).__name__


def parts(x: Payload) -> tuple[Tensor, ...]:
    """The tensors of ``x`` as they travel: a dict's in its key order, its None left out."""
    if isinstance(x, Tensor):
        return (x,)
    if isinstance(x, dict):
        return tuple(t for t in x.values() if t is not None)
    return x


def mapped(x: Payload, fn: Callable[[Tensor], Tensor]) -> Payload:
    """``x`` with ``fn`` applied to each of its tensors (a dict keeps its keys and None)."""
    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: None if t is None else fn(t) for k, t in x.items()}
    return tuple(fn(t) for t in x)


def rebuilt(keys: Sequence[str], present: Sequence[bool], tensors: Sequence[Tensor]) -> Payload:
    """The dict whose :func:`parts` are ``tensors``: ``keys`` in order, None where not
    ``present`` (the dry run's structure, known to both ends of a message)."""
    found = iter(tensors)
    return {k: next(found) if here else None for k, here in zip(keys, present, strict=True)}


class Spec(Protocol):
    """One tensor of a stage boundary, per sample (``executor.TensorSpec``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


def _shape_words(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{tuple(shape)} {dtype}"


def _fits(t: Tensor, p: Spec, n: int) -> bool:
    return (
        t.dim() > 0 and t.shape[0] == n and shape_fits(t.shape[1:], p.shape) and t.dtype == p.dtype
    )


def _mapping_words(
    keys: Sequence[str], values: Sequence[tuple[Sequence[int], torch.dtype] | None]
) -> str:
    inner = ", ".join(
        f"{k!r}: {'None' if v is None else _shape_words(*v)}"
        for k, v in zip(keys, values, strict=True)
    )
    return f"a dict (per sample {{{inner}}})"


def _mapping_mismatch(
    out: dict[str, Tensor | None], spec: Spec | tuple[Spec, ...] | MappingSpec, n: int
) -> tuple[str, str] | None:
    """:func:`boundary_mismatch` of a dict: its keys, which are None, and each tensor's."""
    if (
        isinstance(spec, MappingSpec)
        and tuple(out) == spec.keys
        and all(
            (t is None) == (p is None) and (t is None or p is None or _fits(t, p, n))
            for t, p in zip(out.values(), spec.values, strict=True)
        )
    ):
        return None
    got = _mapping_words(
        list(out), [None if t is None else (t.shape[1:], t.dtype) for t in out.values()]
    )
    batches = sorted({int(t.shape[0]) for t in parts(out) if t.dim() > 0})
    if batches and batches != [n]:
        got += f" for {batches[0]} samples"
    if isinstance(spec, MappingSpec):
        want = _mapping_words(
            spec.keys, [None if p is None else (p.shape, p.dtype) for p in spec.values]
        )
    else:
        want = "a tuple" if isinstance(spec, tuple) else _shape_words(spec.shape, spec.dtype)
    return got, want


def boundary_mismatch(
    out: Payload, spec: Spec | tuple[Spec, ...] | MappingSpec, n: int
) -> tuple[str, str] | None:
    """Where ``out`` differs from the boundary the dry run found (``spec``, per sample) for
    ``n`` samples: (what ``out`` is, what the dry run gave), in words; None where it
    matches. The receiving rank allocates ``spec`` before the message arrives, so a tensor
    whose shape depends on the data could not travel; a dict keeps its keys, and which of
    them are None, since the receiving rank rebuilds it from the dry run's."""
    if isinstance(out, dict):
        return _mapping_mismatch(out, spec, n)
    if isinstance(spec, MappingSpec):
        return describe(out), _mapping_words(
            spec.keys, [None if p is None else (p.shape, p.dtype) for p in spec.values]
        )
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
    """What makes ``h`` unfit to hand on (None: a tensor, a non-empty tuple of tensors, or a
    dict of tensors and None under string keys)."""
    if isinstance(h, Tensor):
        return None
    if isinstance(h, dict):
        return _mapping_problem(h)
    if not isinstance(h, tuple):
        return (
            f"returned {type(h).__name__}; a unit returns one tensor, a tuple of tensors "
            f"(the next unit's positional arguments) or a dict of tensors (its one argument)"
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


def _mapping_problem(h: dict[Any, Any]) -> str | None:
    if not h:
        return "returned an empty dict; return a dict holding at least one tensor"
    for k, v in h.items():
        if not isinstance(k, str):
            return f"returned a dict with the key {k!r}, not a string; name every value by a string"
        if v is not None and not isinstance(v, Tensor):
            return (
                f"returned a dict whose value {k!r} is {type(v).__name__} ({v!r:.40}), which "
                f"cannot cross a stage boundary: every value of a dict a unit hands on is a "
                f"tensor with the batch first, or None (make a flag or a length a tensor, "
                f"and keep other objects in the unit, e.g. as an attribute)"
            )
    if all(v is None for v in h.values()):
        return "returned a dict whose values are all None; hand on at least one tensor"
    return None


def batch_len(x: Payload) -> int:
    """Samples in a batch: the length of its (first) tensor."""
    return len(x) if isinstance(x, Tensor) else len(parts(x)[0])


def head(x: Payload, n: int) -> Payload:
    """The first ``n`` samples of every tensor."""
    return mapped(x, lambda t: t[:n])


def to_device(x: Payload, device: torch.device) -> Payload:
    if isinstance(x, Tensor):
        return x.to(device, non_blocking=True)
    return mapped(x, lambda t: t.to(device, non_blocking=True))


def split(x: Payload, pieces: int) -> list[Payload]:
    """``x`` in ``pieces`` consecutive pieces along the batch (``tensor_split``)."""
    if isinstance(x, Tensor):
        return list(x.tensor_split(pieces))
    if isinstance(x, dict):
        cut = {k: None if t is None else t.tensor_split(pieces) for k, t in x.items()}
        return [{k: None if c is None else c[i] for k, c in cut.items()} for i in range(pieces)]
    split_parts = [t.tensor_split(pieces) for t in x]
    return [tuple(p[i] for p in split_parts) for i in range(pieces)]


def detached(x: Payload) -> Payload:
    return x.detach() if isinstance(x, Tensor) else mapped(x, Tensor.detach)


def payload_bytes(x: Tensor | Sequence[Tensor | None] | Mapping[str, Tensor | None]) -> int:
    """Bytes of a tensor or of the tensors of a tuple or dict (None counts 0)."""
    if isinstance(x, Tensor):
        return x.numel() * x.element_size()
    values = x.values() if isinstance(x, Mapping) else x
    return sum(t.numel() * t.element_size() for t in values if t is not None)


def checked_payload_loss(
    loss_fn: LossFn, out: Payload, target: Tensor, where: str, stage: int
) -> Tensor:
    """``loss_fn(out, target)`` (:func:`~pipeoptim.runtime.stage.loss.checked_loss`); a tuple
    or dict output is passed as it is, and an error names each of its tensors."""
    if isinstance(out, Tensor):
        return checked_loss(loss_fn, out, target, where, stage)
    try:
        loss = loss_fn(out, target)  # type: ignore[arg-type]
    except Exception as err:
        raise StageError(
            f"stage {stage} (the last): the loss failed on {where}: {type(err).__name__}: "
            f"{err} (output {describe(out)}, targets shape {tuple(target.shape)} "
            f"{target.dtype}); the last unit returns a {type(out).__name__}, which the loss is "
            f"given as it is: loss_fn(output, target)"
        ) from err
    return nothing_counted_is_zero(checked_scalar(loss), target)


def checked_tuple(out: Any, stage: int, unit: int, name: str) -> Payload:
    """A tuple or dict a non-last stage hands on, refused (naming the stage and its last
    unit) where it holds something that cannot travel."""
    problem = output_problem(out)
    if problem is not None:
        raise StageError(f"stage {stage}, unit {unit} ({name}) {problem}")
    checked: Payload = out
    return checked


def output_roots(
    out: tuple[Tensor, ...] | dict[str, Tensor | None],
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
    floats = [t for t in parts(out) if t.is_floating_point()]
    if len(given) != len(floats):
        raise RuntimeError(
            f"stage {stage}: {len(given)} gradients for the {len(floats)} floating-point "
            f"tensors of its output"
        )
    pairs = [(t, g) for t, g in zip(floats, given, strict=True) if t.requires_grad]
    return [t for t, _ in pairs], [scaled(g) for _, g in pairs]


def input_gradients(
    x_in: tuple[Tensor, ...] | dict[str, Tensor | None],
    found: Sequence[Tensor | None],
    true_gradient: Callable[[Tensor | None], Tensor | None],
) -> tuple[Tensor | None, ...]:
    """A tuple or dict input's gradient as sent upstream: per floating-point tensor of its
    :func:`parts` (zeros where it got none, unscaled by ``true_gradient``), None for the
    others (``found``: per part)."""
    return tuple(
        (true_gradient(g) if g is not None else torch.zeros_like(t))
        if t.is_floating_point()
        else None
        for t, g in zip(parts(x_in), found, strict=True)
    )
