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

__all__ = ["ForwardSaves", "SavedBytes"]


class SavedBytes:
    """Bytes of activations a forward saves for its backward: the one counting rule of the
    runtime's hook and of the profiler (``runtime/profiling/profiler.py``), so the profile's
    ``saved_bytes`` and the stage's count agree.

    Per storage that is not a weight, the bytes its saved views reach, once (the union of
    their spans). Why the span and not the whole storage: a stage-0 micro-batch is a view of
    the mini-batch, which the caller holds whole until the step ends anyway; counting the
    storage would book the mini-batch once per micro-batch in flight, where the spans of the
    micro-batches in flight add up to it. A view over all of its storage (a transpose, the
    q, k and v slices of one projection) counts all of it."""

    def __init__(self, weight_ptrs: set[int] | None = None) -> None:
        self.weight_ptrs: set[int] = weight_ptrs if weight_ptrs is not None else set()
        """Storages that are weights, not activations (shared with the caller)."""
        self._spans: dict[int, list[tuple[int, int]]] = {}  # storage -> disjoint [lo, hi)
        self.total = 0

    def add(self, t: Tensor) -> None:
        """Count what ``t`` reaches of its storage, less what was counted already."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.weight_ptrs:
            return
        size = t.element_size()
        lo = int(t.storage_offset()) * size
        reach = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
        hi = lo + (reach + 1) * size if t.numel() else lo
        hi = min(hi, storage.nbytes())
        if hi <= lo:
            return
        spans = self._spans.setdefault(ptr, [])
        before = sum(b - a for a, b in spans)
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if b < lo or a > hi:
                merged.append((a, b))
            else:
                lo, hi = min(a, lo), max(b, hi)
        merged.append((lo, hi))
        self._spans[ptr] = merged
        self.total += sum(b - a for a, b in merged) - before


class ForwardSaves:
    """The pack side of one forward's saved-tensor hook (unpack: ``precision.unpack``)."""

    def __init__(self, sources: Iterable[Tensor], recast_dtype: torch.dtype | None) -> None:
        self.recast_dtype = recast_dtype
        """Saved tensors of this dtype may be weight casts to re-cast (None: none are)."""
        self.weight_ptrs = {t.untyped_storage().data_ptr() for t in sources}
        self.aliases: dict[Any, Tensor] = {}
        """The autograd node of each weight alias -> the weights its backward reads."""
        self.live_of: dict[int, tuple[Tensor, Tensor]] = {}  # buffer storage -> (buffer, live)
        self._bytes = SavedBytes(self.weight_ptrs)

    @property
    def activation_bytes(self) -> int:
        """Bytes of activations counted so far (:class:`SavedBytes`)."""
        return self._bytes.total

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
        input, which the recomputation reads), as a saved one."""
        self._bytes.add(t)

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
        self._bytes.add(t)
        return t
