"""A stage's weight versions: which storage each pass reads, and what is kept for later ones.

Why aliases: the forward does not read the parameters themselves but *aliases* of their
storage (:func:`alias`: a tensor on the same memory with its own version counter, whose
gradient flows to the parameter). Two things follow:

* an optimizer step between a forward and its backward is legal (it bumps the parameter's
  version counter, not the alias's), and the backward reads whatever the aliased storage
  holds when it runs;
* a version is kept simply by keeping its storage: before an update, if some pass still
  needs the current version (PipeDream's stash, 2BW's previous buffer), the parameter moves
  to a fresh copy and the old storage stays frozen with the graphs that alias it.

An alias reads its storage and nothing else, so the forwards that read the same storage
share one alias per weight (:meth:`WeightVersions.aliases`): every micro-batch of a mini-batch
on 2BW's previous buffer, every predicted forward on the prediction buffer. Each backward
walks only its own graph, so a shared alias passes each micro-batch's gradient on by itself,
as its own alias did. The store drops an alias with the version it reads.

A predicted forward's backward reads the live weights. Where each predicted forward meets
exactly one update before its backward (XPipe with M >= P), the prediction buffer becomes the
live weights at that update (:meth:`WeightVersions.before_update`): it takes their values, the
parameters move onto its storage and the optimizer updates them there, so the graphs read
the current weights where they read Ŵ, with no saved-tensor hook on their passes; the old
storage is the next buffer. One copy per update instead of a hook on every saved tensor, so
only where several predicted forwards meet each update (``Stage._buffer_becomes_live``).

Under the asynchronous policies in fp32 (``Stage._grads_on_leaves``), the forwards read
*leaves* on a version's storage instead of aliases (:func:`leaf`,
:attr:`WeightVersions.leaf_grads`): a leaf's gradient accumulates on the leaf, with no view
node per weight in each backward (issue 34: those nodes cost about 5 µs a weight per
forward and backward of gpt-deep on a 2-core machine). For the length of a backward the
parameters' gradients so far move onto the leaves its graph reads, and back after it
(:meth:`WeightVersions.adding_for`): every backward adds onto the same running sum, in the
same order, as through aliases (the same weights bit for bit), and between passes ``.grad``
holds it as always.

Per policy (docs/design.md, "Weight-version semantics"): FLUSH runs everything on the live
weights. STASH forwards on the live weights, which are frozen at the next update if the
mini-batch is still in flight (one copy per version in flight). DOUBLE_BUFFER runs every
micro-batch of mini-batch t on ``W^(t-1)`` (the live weights or the one frozen previous
version). PREDICT keeps no old version: its forward runs on Ŵ written into the one
prediction buffer held here (or, for a predicted backward, into a copy held by the graph).

The versions every pass meets come from ``plan.versions.analyze_versions`` of the schedule the
executor runs; the store checks them at every pass, so the runtime and the analysis cannot
disagree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.plan.versions import MicroBatchVersions

__all__ = ["WeightVersions", "alias", "leaf"]


def _storage_key(tensors: Sequence[Tensor]) -> tuple[int, ...]:
    """Which storage a version's tensors are, for the aliases made on it."""
    return tuple(t.data_ptr() for t in tensors)


def alias(param: Tensor, source: Tensor) -> Tensor:
    """A tensor on ``source``'s storage (a version of ``param``: same shape and dtype) whose
    gradient flows to ``param``, with a version counter of its own: an update of ``param``
    or ``source`` in place does not invalidate what a graph saved of it.

    An ``_unsafe_view`` of ``param`` re-pointed at ``source``: autograd keeps it as an output
    of its own whose backward (a reshape, in C++) hands the gradient to ``param``. A Python
    ``autograd.Function`` cost a call into Python per weight on every backward (issue 34).
    """
    out: Tensor = torch.ops.aten._unsafe_view(param, param.shape)
    with torch.no_grad():
        out.set_(source.untyped_storage(), source.storage_offset(), source.size(), source.stride())
    return out


def leaf(source: Tensor) -> Tensor:
    """A leaf on ``source``'s storage that takes gradients, with a version counter of its
    own (as an :func:`alias` has): its gradient accumulates on it, not on a parameter."""
    out = torch.empty(0, dtype=source.dtype, device=source.device)
    out.set_(source.untyped_storage(), source.storage_offset(), source.size(), source.stride())
    return out.requires_grad_()


class WeightVersions:
    """The versions of one stage's trainable weights within a never-flushed segment: the live
    ones (version :attr:`current`), the frozen ones still needed, the prediction buffer, and
    the count of weight copies held (for the memory report)."""

    def __init__(self, policy: WeightPolicy, params: Sequence[Tensor], stage: int) -> None:
        self.stage = stage
        self.params = params
        self.tracks = not policy.reads_predicted
        """Whether passes read kept versions (every policy but PREDICT)."""
        self.passes: dict[int, MicroBatchVersions] = {}
        self.current = 0
        """Updates in this segment: the live weights are this version."""
        self.stash: dict[int, list[Tensor]] = {}  # frozen versions still needed
        self._pending_f: Counter[int] = Counter()  # forwards still to run, by version
        self._inflight: Counter[int] = Counter()  # forwards awaiting backward, by version
        self.predicted: list[Tensor] | None = None  # Ŵ of a predicted forward (reused)
        self.held: set[int] = set()  # micro-batches whose graph holds their own Ŵ
        self.on_buffer: dict[int, int] = {}
        """Predicted micro-batches in flight whose graph reads the prediction buffer itself,
        by the version their forward ran at: the buffer becomes the live weights at the
        next update."""
        self.peak_copies = 1
        self._aliases: dict[tuple[int, ...], list[Tensor]] = {}  # storage -> its aliases
        self.leaf_grads = False
        """Whether forwards read leaves (:func:`leaf`) rather than aliases (set per segment
        by the stage)."""
        self._reads: dict[int, list[Tensor]] = {}  # micro-batch -> the leaves its forward read

    def begin_segment(self, passes: dict[int, MicroBatchVersions]) -> None:
        """Start a segment; versions count from 0 within it."""
        self.passes = passes
        self.current = 0
        self._inflight = Counter()
        self._aliases = {}
        self._reads = {}
        self.on_buffer = {}
        self._pending_f = Counter(p.forward_version for p in passes.values() if self.tracks)

    def of(self, mb: int) -> MicroBatchVersions:
        """The versions micro-batch ``mb`` of this segment meets on this stage."""
        try:
            return self.passes[mb]
        except KeyError:
            raise RuntimeError(
                f"stage {self.stage}: micro-batch {mb} is not in this segment"
            ) from None

    def sources(self, version: int, mb: int) -> list[Tensor]:
        """The storage of ``version`` for the forward of ``mb`` (counted as in flight)."""
        if not self.tracks or version == self.current:
            sources = [p.data for p in self.params]
        elif version in self.stash:
            sources = self.stash[version]
        else:
            raise RuntimeError(
                f"stage {self.stage}: forward of micro-batch {mb} needs version {version}, "
                f"which the stage does not hold (live {self.current}, kept {sorted(self.stash)})"
            )
        if self.tracks:
            self._pending_f[version] -= 1
            self._inflight[version] += 1
        return sources

    def aliases(self, sources: Sequence[Tensor], mb: int) -> list[Tensor]:
        """An alias of each of ``sources`` (a version's storage, or the prediction buffer)
        whose gradient flows to its parameter, or a leaf on it under :attr:`leaf_grads`
        (the forward of ``mb`` reads it): made on the first forward that reads that
        storage, shared by the later ones."""
        key = _storage_key(sources)
        found = self._aliases.get(key)
        if found is None:
            if self.leaf_grads:
                found = [leaf(t) for t in sources]
            else:
                found = [alias(p, t) for p, t in zip(self.params, sources, strict=True)]
            self._aliases[key] = found
        if self.leaf_grads:
            self._reads[mb] = found
        return found

    @contextmanager
    def adding_for(self, mb: int) -> Iterator[None]:
        """Around the backward of ``mb``: where its forward read leaves, each parameter's
        gradient so far is on its leaf while the backward adds to it, then back on the
        parameter (also when the backward fails)."""
        leaves = self._reads.pop(mb, None)
        if leaves is None:
            yield
            return
        for p, t in zip(self.params, leaves, strict=True):
            t.grad, p.grad = p.grad, None
        try:
            yield
        finally:
            for p, t in zip(self.params, leaves, strict=True):
                p.grad, t.grad = t.grad, None

    def check_backward(self, v: MicroBatchVersions, mb: int) -> None:
        """Refuse a backward whose weights the stage no longer holds."""
        if v.backward_version != self.current and v.backward_version not in self.stash:
            raise RuntimeError(
                f"stage {self.stage}: backward of micro-batch {mb} needs version "
                f"{v.backward_version}, which the stage no longer holds (live {self.current})"
            )

    def before_update(self) -> None:
        """Freeze the live version where a pass still needs it, so the step writes a copy;
        make the prediction buffer the live weights where a graph reads it."""
        cur = self.current
        if self.on_buffer:
            self._adopt_prediction()
        if self.tracks and self._pending_f[cur] + self._inflight[cur] > 0:
            # The live storage becomes the frozen version (graphs alias it); the parameter
            # moves to a copy, which the optimizer updates.
            self.stash[cur] = [p.data for p in self.params]
            for p in self.params:
                p.data = p.data.clone()
            self.note_copies()

    def _adopt_prediction(self) -> None:
        """The prediction buffer takes the live weights' values and their place: the
        parameters move onto its storage, the old storage is the next buffer."""
        late = sorted(mb for mb, v in self.on_buffer.items() if v != self.current)
        if late:
            raise RuntimeError(
                f"stage {self.stage}: micro-batches {late} read the prediction buffer across "
                f"more than one update; their backward would miss the live weights"
            )
        buffer = self.predicted
        assert buffer is not None  # a graph reads it
        live = [p.data for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(buffer, live)
        for p, b in zip(self.params, buffer, strict=True):
            p.data = b
        self.predicted = live

    def after_update(self) -> None:
        self.current += 1
        self.note_copies()

    def retire(self, v: MicroBatchVersions) -> None:
        """A micro-batch's backward is complete: release the version its forward held."""
        if self.tracks:
            version = v.forward_version
            self._inflight[version] -= 1
            self._drop_if_unneeded(version)

    def forget(self, mbs: list[int]) -> None:
        """Forwards that will not run (a segment a stop cut short): their versions are no
        longer needed for them, and a frozen one nobody else needs is dropped."""
        if not self.tracks:
            return
        for mb in mbs:
            version = self.passes[mb].forward_version
            self._pending_f[version] -= 1
            self._drop_if_unneeded(version)

    def _drop_if_unneeded(self, version: int) -> None:
        """Drop a frozen version no forward is still to read and no backward still needs,
        with its aliases (they hold its storage)."""
        if version in self.stash and self._pending_f[version] + self._inflight[version] <= 0:
            self._aliases.pop(_storage_key(self.stash.pop(version)), None)

    def prediction_buffer(self) -> list[Tensor]:
        """The stage's one buffer for Ŵ (the extra weight copy), made on first use."""
        if self.predicted is None:
            self.predicted = [torch.empty_like(p) for p in self.params]
            self.note_copies()
        return self.predicted

    def held_copy(self) -> list[Tensor]:
        """A fresh copy for a Ŵ the graph keeps for its backward (one per micro-batch)."""
        copy = [torch.empty_like(p) for p in self.params]
        self.peak_copies = max(self.peak_copies, self.copies() + 1)
        return copy

    def copies(self) -> int:
        """Weight copies held now: live, frozen versions, the predicted-forward buffer."""
        buffer = 1 if self.predicted is not None else 0
        return 1 + len(self.stash) + buffer + len(self.held)

    def note_copies(self) -> None:
        self.peak_copies = max(self.peak_copies, self.copies())
