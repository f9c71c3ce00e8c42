"""What crosses a stage boundary, per sample: the shape and dtype a receiving rank allocates.

A leaf of its own because three layers meet on it: the dry run (``probe``) finds the
boundaries, the ``Pipeline`` keeps them, and the executor allocates its receives from them;
each imports the type without the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

__all__ = ["Boundary", "TensorSpec"]


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
