"""What crosses a stage boundary, per sample: the shape and dtype a receiving rank allocates.

A leaf of its own because three layers meet on it: the dry run (``probe``) finds the
boundaries, the ``Pipeline`` keeps them, and the executor allocates its receives from them;
each imports the type without the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

__all__ = ["VARIES", "Boundary", "MappingSpec", "TensorSpec", "loosened", "shape_fits"]

VARIES = -1
"""A per-sample dimension that may change from batch to batch (``CommOptions.
varying_shapes``): a receive spec that holds it takes the message's shape from the message."""


@dataclass(frozen=True)
class TensorSpec:
    """One sample of a tensor a stage hands on (or of the targets): what a receiving rank
    allocates."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.dtype if self.dtype.is_floating_point else torch.float32


@dataclass(frozen=True)
class MappingSpec:
    """A mapping a stage hands on, per sample: its keys in the order the dry run saw them,
    and per key the tensor's spec, or None where the value was None. It travels as its
    tensors in that key order (the parts of a tuple); a None travels as nothing."""

    keys: tuple[str, ...]
    values: tuple[TensorSpec | None, ...]

    @property
    def parts(self) -> tuple[TensorSpec, ...]:
        """The specs of the tensors that travel, in key order."""
        return tuple(v for v in self.values if v is not None)


Boundary: TypeAlias = TensorSpec | tuple[TensorSpec, ...] | MappingSpec
"""What crosses a stage boundary, per sample: one tensor, a tuple of them (the next stage's
first unit takes them as its positional arguments), or a mapping of them (the next stage's
first unit takes it as one argument). The gradient sent back carries the floating-point
tensors of a tuple or a mapping only."""


def loosened(b: Boundary) -> Boundary:
    """``b`` with every per-sample dimension :data:`VARIES` (rank and dtype kept): what a
    receiving rank expects when shapes vary, the sender's message giving the sizes."""
    if isinstance(b, MappingSpec):
        return MappingSpec(b.keys, tuple(None if v is None else _loose(v) for v in b.values))
    if isinstance(b, tuple):
        return tuple(_loose(p) for p in b)
    return _loose(b)


def _loose(spec: TensorSpec) -> TensorSpec:
    return TensorSpec((VARIES,) * len(spec.shape), spec.dtype)


def shape_fits(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether ``shape`` is ``want``, a :data:`VARIES` dimension of ``want`` taking any size."""
    return len(shape) == len(want) and all(
        w in (d, VARIES) for d, w in zip(shape, want, strict=True)
    )
