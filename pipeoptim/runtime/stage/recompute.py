"""Activation recomputation of chosen units of a stage, under every weight policy.

How: each run of consecutive recomputed units is one region run under
``torch.utils.checkpoint`` (non-reentrant), which keeps only the region's input and, at its
backward, runs its forward again, with the RNG state and autocast of the first run, before
walking its graph (so recomputing a whole stage keeps only the stage's input). What that
second forward reads decides whether it is the same computation (docs/design.md, "Activation
recomputation and weight versions"):

* flush methods: the module's own parameters, unchanged between a forward and its backward;
* stash and double-buffer methods: the version the forward read, whose storage the stage
  froze (the recomputation closes over it, so it stays until the backward);
* predicting methods: the predicted Ŵ. The stage writes each forward's Ŵ into one buffer that
  the next forward overwrites, so a recomputed unit keeps its own copy of Ŵ until its backward
  (a weight copy of the recomputed units per micro-batch in flight). Once the recomputation
  has run, the copy is overwritten with the live weights, so that the backward reads the
  current weights, as the stage's saved-tensor hook makes an unrecomputed one do; under
  autocast the casts of Ŵ the recomputation saved are re-cast from the live weights too.

So a recomputed run equals the same run without recomputation bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from pipeoptim.errors import StageError
from pipeoptim.runtime.model.replay import recomputing
from pipeoptim.runtime.payload import Payload, parts
from pipeoptim.runtime.stage.chain import UnitChain
from pipeoptim.runtime.stage.swap import ParameterSlots
from pipeoptim.runtime.stage.weights import alias

__all__ = ["Recomputation", "RegionWeights", "Steps", "release_output", "run_steps"]


def _storage_view(t: Tensor) -> Tensor:
    """A tensor on ``t``'s memory with its own version counter: writing through it does not
    mark ``t`` as modified for autograd (as an optimizer step does not mark a weight alias)."""
    out = t.new_empty((0,))
    return out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


class _CastRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the casts of tensors on ``storages`` that a recomputation makes."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages = storages
        self.casts: list[tuple[Tensor, Tensor]] = []  # (cast, what it cast)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, Tensor):
            source = args[0]
            if source.untyped_storage().data_ptr() in self.storages:
                self.casts.append((out, source))
        return out


class _Replay(AbstractContextManager[None]):
    """The context a unit's forward runs again in: marked as a recomputation
    (``model/replay.py``), with the unit's buffers put back afterwards (a batch norm's
    running statistics were updated when the forward first ran)."""

    def __init__(self, units: Sequence[nn.Module], to_live: _ToLive | None) -> None:
        self.buffers = [b for u in units for b in u.buffers()]
        self.to_live = to_live
        self.saved: list[Tensor] = []
        self.flag: AbstractContextManager[None] = nullcontext()

    def __enter__(self) -> None:
        # entered once per recomputation: a split backward recomputes for its I and its W
        self.saved = [b.detach().clone() for b in self.buffers]
        self.flag = recomputing()
        self.flag.__enter__()
        if self.to_live is not None:
            self.to_live.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.to_live is not None:
                self.to_live.__exit__(*exc)
        finally:
            self.flag.__exit__(*exc)
            with torch.no_grad():
                for b, before in zip(self.buffers, self.saved, strict=True):
                    _storage_view(b).copy_(before)
            self.saved = []


class _ToLive(AbstractContextManager[None]):
    """The recomputation context of a unit of a predicting stage: records the casts of Ŵ
    while the forward runs again, then (whether it ran to the end or checkpoint stopped it
    early) overwrites the held Ŵ with the live weights and re-casts those casts from them."""

    def __init__(self, pairs: Sequence[tuple[Tensor, Tensor]], recast: bool) -> None:
        self.pairs = pairs  # (held Ŵ, live parameter)
        self.recorder = (
            _CastRecorder({h.untyped_storage().data_ptr() for h, _ in pairs}) if recast else None
        )

    def __enter__(self) -> None:
        if self.recorder is not None:
            self.recorder.__enter__()  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: object) -> None:
        if self.recorder is not None:
            self.recorder.__exit__(*exc)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for held, live in self.pairs:
                _storage_view(held).copy_(live.detach())
            if self.recorder is not None:
                for cast, source in self.recorder.casts:
                    _storage_view(cast).copy_(source)
                self.recorder.casts.clear()


@dataclass
class RegionWeights:
    """What the recomputed units of one forward read: per stage parameter index, the tensor
    whose storage they alias (None: the module's own parameters, a flush method), and for a
    predicting stage the copies of Ŵ they hold, to be overwritten with the live weights."""

    sources: Sequence[Tensor] | None
    held: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    """(unit, stage parameter index) -> that unit's copy of Ŵ (a weight two recomputed units
    share has a copy each: the first recomputation overwrites its own with the live one)."""
    recast: bool = False


class Recomputation:
    """Which units of a stage recompute, and how a forward runs them.

    ``units``: stage-local indices; ``params``: the stage's trainable parameters in its
    order (what weight aliases are indexed by)."""

    def __init__(
        self, module: nn.Module, units: frozenset[int], params: Sequence[Tensor], stage: int
    ) -> None:
        chain = list(module) if isinstance(module, UnitChain) else [module]
        bad = sorted(u for u in units if not 0 <= u < len(chain))
        if bad:
            raise StageError(
                f"stage {stage}: recompute names stage-local units {bad}, but the stage has "
                f"{len(chain)} (0..{len(chain) - 1}); name units the stage holds"
            )
        self.stage = stage
        self.chain = chain
        self.units = units
        index = {id(p): j for j, p in enumerate(params)}
        self.unit_weights: list[list[tuple[str, int]]] = [
            [
                (n, index[id(p)])
                for n, p in u.named_parameters(remove_duplicate=False)
                if id(p) in index
            ]
            for u in chain
        ]
        """Per unit: (its parameter's name in the unit, the stage's parameter index)."""
        self.slots = [ParameterSlots(u, params) for u in chain]
        """Per unit: where it holds each stage parameter (a forward on aliases fills them)."""
        self.params = params
        self.held_keys = sorted({(u, j) for u in units for _, j in self.unit_weights[u]})
        """(unit, stage parameter index) of every copy of Ŵ a predicted forward holds."""
        self.held_bytes = sum(
            params[j].numel() * params[j].element_size() for _, j in self.held_keys
        )
        """Bytes of those copies: what a predicted forward holds until its backward."""
        self.ends_stage = len(chain) - 1 in units
        """The stage's last unit is recomputed: its output is in no saved graph, so the
        stage lets go of it once sent (:func:`release_output`)."""

    def hold_prediction(self, sources: Sequence[Tensor], recast: bool) -> RegionWeights:
        """Copies of Ŵ (``sources``: the prediction buffer) for the recomputed units."""
        held = {(u, j): sources[j].clone() for u, j in self.held_keys}
        return RegionWeights(sources, held, recast)

    def steps(
        self,
        weights: Sequence[Tensor] | None,
        region: RegionWeights,
        keep: Callable[[Tensor], None] | None = None,
    ) -> Steps:
        """How a forward runs the stage's units: (unit indices, what runs them on their
        arguments) in order, an unrecomputed unit alone, and each run of consecutive
        recomputed units as one region, which keeps only its first unit's input.
        Unrecomputed units read ``weights`` (an alias per stage parameter; None: the
        module's parameters), recomputed ones ``region``; ``keep`` is told each input a
        region keeps."""
        out: Steps = []
        i = 0
        while i < len(self.chain):
            if i not in self.units:
                out.append(([i], self._direct(i, weights)))
                i += 1
                continue
            end = i
            while end < len(self.chain) and end in self.units:
                end += 1
            segment = list(range(i, end))
            out.append((segment, self._checkpointed(segment, region, keep)))
            i = end
        return out

    def _direct(self, i: int, weights: Sequence[Tensor] | None) -> Callable[..., Any]:
        unit = self.chain[i]
        if weights is None:
            return unit
        slots = self.slots[i]
        return lambda *a: slots.call(unit, weights, a)

    def _checkpointed(
        self,
        segment: list[int],
        region: RegionWeights,
        keep: Callable[[Tensor], None] | None,
    ) -> Callable[..., Any]:
        """Units ``segment`` (consecutive) as one checkpointed region."""
        sources, held, params = region.sources, region.held, self.params
        modules = [self.chain[i] for i in segment]
        slots = [self.slots[i] for i in segment]
        reads: list[dict[int, Tensor]] = []  # per unit: stage parameter index -> its weights
        if sources is not None:
            reads = [
                {j: held.get((i, j), sources[j]) for _, j in self.unit_weights[i]} for i in segment
            ]

        def forward(*a: Any) -> Any:
            h: Any = a
            for u, unit in enumerate(modules):
                args = _args(h)
                if sources is None:
                    h = unit(*args)
                else:
                    # fresh aliases each run: the recomputation's graph is its own
                    mine = {j: alias(params[j], t) for j, t in reads[u].items()}
                    h = slots[u].call(unit, mine, args)
            return h

        pairs = list({id(t): (t, params[j]) for (i, j), t in held.items() if i in segment}.values())

        def contexts() -> tuple[Any, Any]:
            return nullcontext(), _Replay(modules, _ToLive(pairs, region.recast) if pairs else None)

        def run(*a: Any) -> Any:
            if keep is not None:
                for arg in a:
                    for t in arg.values() if isinstance(arg, dict) else (arg,):
                        if isinstance(t, Tensor):
                            keep(t)
            return checkpoint(forward, *a, use_reentrant=False, context_fn=contexts)

        return run


Steps = list[tuple[list[int], Callable[..., Any]]]
"""What :meth:`Recomputation.steps` returns: (unit indices, what runs them), in order."""


def release_output(out: Payload, inputs: Payload) -> None:
    """Let go of the storage of the stage output ``out`` (sent downstream by the caller
    through a detached alias, which holds it until the send is done), keeping its shape
    and autograd graph: the backward from ``out`` with the incoming gradient reads only
    its metadata. For a stage whose last unit is recomputed, whose graph saves nothing of
    the output (the checkpoint keeps its region's input and rebuilds the rest): the
    planner counts no output there (``plan/recompute_costs.py``), as Megatron frees its
    pipeline outputs. Each tensor is given a stand-in on an empty storage (``.data``), so
    any other tensor on the same memory (the receiver's alias under the local transport)
    keeps it; a tensor the stage did not compute (an input handed on) is left alone."""
    kept = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    for t in _tensors(out):
        if t.grad_fn is None or t.untyped_storage().data_ptr() in kept:
            continue
        stand_in = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
        stand_in.untyped_storage().resize_(0)  # never written: the allocation is not touched
        t.data = stand_in


def _tensors(x: Payload) -> tuple[Tensor, ...]:
    return tuple(t for t in parts(x) if isinstance(t, Tensor))  # a dict's values, None out


def run_steps(steps: Steps, x: Payload) -> Payload:
    """The stage's units on ``x``, as ``steps`` run them."""
    h: Any = x
    for _, step in steps:
        h = step(*_args(h))
    out: Payload = h
    return out


def _args(h: Any) -> tuple[Any, ...]:
    """A unit's positional arguments: a tuple handed on as it is, anything else alone."""
    return h if isinstance(h, tuple) else (h,)
