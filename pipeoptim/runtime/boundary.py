"""What crosses a stage boundary, per sample: the shape and dtype a receiving rank allocates.

A leaf of its own because three layers meet on it: the dry run (``probe``) finds the
boundaries, the ``Pipeline`` keeps them, and the executor allocates its receives from them;
each imports the type without the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

__all__ = ["VARIES", "Boundary", "TensorSpec", "loosened", "shape_fits"]

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


Boundary: TypeAlias = TensorSpec | tuple[TensorSpec, ...]
"""What crosses a stage boundary, per sample: one tensor, or a tuple of them (the next
stage's first unit takes them as its positional arguments). The gradient sent back carries
the floating-point tensors of a tuple only."""


def loosened(b: Boundary) -> Boundary:
    """``b`` with every per-sample dimension :data:`VARIES` (rank and dtype kept): what a
    receiving rank expects when shapes vary, the sender's message giving the sizes."""
    if isinstance(b, tuple):
        return tuple(TensorSpec((VARIES,) * len(p.shape), p.dtype) for p in b)
    return TensorSpec((VARIES,) * len(b.shape), b.dtype)


def shape_fits(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether ``shape`` is ``want``, a :data:`VARIES` dimension of ``want`` taking any size."""
    return len(shape) == len(want) and all(
        w in (d, VARIES) for d, w in zip(shape, want, strict=True)
    )
