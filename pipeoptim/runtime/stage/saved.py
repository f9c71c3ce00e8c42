"""What one forward's graph keeps for its backward, as a saved-tensor hook sees it.

Why a hook: three of the stage's rules act on the tensors autograd saves, not on the
forward's code, so they work for any layer. The hook

* counts the bytes of activations (every saved storage that is not a weight, once);
* under mixed precision, drops a saved cast of a weight and keeps a
  :class:`~pipeoptim.runtime.stage.precision.Recast` instead, so the backward casts the weights the
  policy says it reads (``aliases``: each weight alias's node to those weights);
* for a predicted forward, re-points a saved view of Ŵ (the prediction buffer) at the same
  view of the live weights, so the backward runs on the current weights (docs/design.md,
  "Weight-version semantics").

The stage installs it only where one of these is needed (see ``Stage.forward``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from pipeoptim.runtime.stage.precision import Recast, cast_source

__all__ = ["ForwardSaves"]


class ForwardSaves:
    """The pack side of one forward's saved-tensor hook (unpack: ``precision.unpack``)."""

    def __init__(self, sources: Iterable[Tensor], recast_dtype: torch.dtype | None) -> None:
        self.recast_dtype = recast_dtype
        """Saved tensors of this dtype may be weight casts to re-cast (None: none are)."""
        self.weight_ptrs = {t.untyped_storage().data_ptr() for t in sources}
        self.aliases: dict[Any, Tensor] = {}
        """The autograd node of each weight alias -> the weights its backward reads."""
        self.live_of: dict[int, tuple[Tensor, Tensor]] = {}  # buffer storage -> (buffer, live)
        self._counted: set[int] = set()
        self.activation_bytes = 0

    def add_weights(self, tensors: Iterable[Tensor]) -> None:
        """More weight storage the forward reads (a Ŵ its graph holds): not activations."""
        self.weight_ptrs.update(t.untyped_storage().data_ptr() for t in tensors)

    def repoint(self, buffers: Iterable[Tensor], live: Iterable[Tensor]) -> None:
        """Saved views of ``buffers`` (Ŵ) are to be read from ``live`` at backward."""
        for buffer, w in zip(buffers, live, strict=True):
            self.live_of[buffer.untyped_storage().data_ptr()] = (buffer, w)
        self.weight_ptrs.update(self.live_of)

    def keep(self, t: Tensor) -> None:
        """Count a tensor the forward keeps outside autograd's saves (a recomputed unit's
        input, which the recomputation reads), once per storage."""
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.weight_ptrs and ptr not in self._counted:
            self._counted.add(ptr)
            self.activation_bytes += t.untyped_storage().nbytes()

    def pack(self, t: Tensor) -> Tensor | Recast:
        if self.recast_dtype is not None and t.dtype == self.recast_dtype:
            source = cast_source(t, self.aliases)
            if source is not None:
                return Recast(source, t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset()))
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.live_of:  # a view of Ŵ: the same view of the live weights
            buffer, live = self.live_of[ptr]
            offset = live.storage_offset() + t.storage_offset() - buffer.storage_offset()
            return Recast(live, t.dtype, tuple(t.shape), t.stride(), int(offset))
        if ptr not in self.weight_ptrs and ptr not in self._counted:
            self._counted.add(ptr)
            self.activation_bytes += t.untyped_storage().nbytes()
        return t
