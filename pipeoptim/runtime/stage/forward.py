"""A stage's forward: the pass that reads a weight version and leaves its graph for the backward.

Why its own module: the forward is where the weight-version rule (docs/design.md,
"Weight-version semantics") meets autograd. It picks the storage the micro-batch's version
lives in, runs the module on the parameters themselves or on aliases of that storage in the
module's slots (:mod:`~pipeoptim.runtime.stage.swap`), writes or keeps the prediction Ŵ
(:mod:`~pipeoptim.runtime.stage.prediction`), hooks what the graph saves where a saved cast is
re-cast or a predicted forward's saved weights are re-pointed at the live ones
(:mod:`~pipeoptim.runtime.stage.saved`), and keeps what a split backward or a recomputation
needs. It finishes the previous backward first (:mod:`~pipeoptim.runtime.stage.backward`), so
it sits above the backward and the prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from pipeoptim.errors import StageError
from pipeoptim.plan.versions import MicroBatchVersions
from pipeoptim.runtime.payload import (
    Payload,
    checked_payload_loss,
    checked_tuple,
    detached,
    mapped,
    parts,
)
from pipeoptim.runtime.stage.backward import StageBackward
from pipeoptim.runtime.stage.diagnose import describe_failure
from pipeoptim.runtime.stage.loss import count_correct, token_share
from pipeoptim.runtime.stage.precision import unpack
from pipeoptim.runtime.stage.prediction import StagePrediction
from pipeoptim.runtime.stage.recompute import (
    RegionWeights,
    Steps,
    release_output,
    run_steps,
)
from pipeoptim.runtime.stage.saved import ForwardSaves
from pipeoptim.runtime.stage.split_backward import KeptUnits, reentrant_refusal, run_units_kept
from pipeoptim.runtime.stage.weights import alias

__all__ = ["StageForward"]


class StageForward(StageBackward, StagePrediction):
    """The forward of a stage (training and evaluation), and the unit runs and checks it
    makes."""

    # -- passes ----------------------------------------------------------------------------
    def _run_units(self, weights: Sequence[Tensor] | None, x: Payload) -> Payload:
        """The stage's units on ``x``, with ``weights`` (one per parameter, in the stage's
        order) in the module's slots (None: its parameters); a tuple ``x`` is the first
        unit's positional arguments."""
        args = x if isinstance(x, tuple) else (x,)
        try:
            if weights is None:
                out: Payload = self.module(*args)
            else:
                out = self._slots.call(self.module, weights, args)
        except Exception as err:
            raise StageError(self._failure(x, err)) from err
        return out

    def _run_recomputed(self, steps: Steps, x: Payload) -> Payload:
        """The stage's units on ``x`` as ``steps`` run them, some recomputed
        (``recompute.py``)."""
        try:
            return run_steps(steps, x)
        except Exception as err:
            raise StageError(self._failure(x, err)) from err

    def _failure(self, x: Payload, err: Exception) -> str:
        with self.precision.autocast():
            return describe_failure(
                list(self.module), x, stage=self.index, first_unit=self.first_unit, error=err
            )

    def loss(self, out: Payload, target: Tensor, where: str) -> Tensor:
        """``loss_fn(out, target)``, checked to be a scalar; errors name the values. A tuple
        output (the last unit returned one) is given to the loss as it is."""
        return checked_payload_loss(self.loss_fn, out, target, where, self.index)

    def count_correct(self, out: Payload, target: Tensor) -> Tensor | None:
        """Correct argmax predictions, where the output is a score per class of each target
        (None for a tuple output: which of its tensors holds the scores is the loss's)."""
        return count_correct(out, target) if isinstance(out, Tensor) else None

    def _tuple_out(self, out: Any) -> Payload:
        """A tuple or dict a non-last stage hands on, refused where it holds what cannot
        travel."""
        last = self.first_unit + len(self.module) - 1
        return checked_tuple(out, self.index, last, type(self.module[-1]).__name__)

    def _on_parameters(self, v: MicroBatchVersions, s: int) -> bool:
        """Whether a forward runs the module on its own parameters, with no alias per
        parameter: where no update comes between it and its backward and it reads the live
        weights. Always under flush methods; under asynchronous ones a forward of s = 0 on
        the live weights (XPipe's that predict nothing). Its backward reads what the forward
        read, as an alias of the live storage would."""
        if self.policy.keeps_one_version:
            return True
        return s == 0 and v.distance == 0 and v.forward_version == self.weights.current

    def forward(
        self,
        mb: int,
        x: Payload,
        target: Tensor | None = None,
        counted: Tensor | int | None = None,
    ) -> Payload:
        """Run micro-batch ``mb``; returns the (detached) output, or on the last stage the
        loss as its share of the mini-batch's token mean (``counted``: the mini-batch's
        counted targets; :func:`~pipeoptim.runtime.stage.loss.token_share`; None: divided by
        M). ``x`` and the output may be tuples of tensors (a unit's positional arguments);
        the floating-point ones take gradients."""
        self.finish_backward()
        v = self.versions(mb)
        store = self.weights
        if v.forward_base != store.current:
            raise RuntimeError(
                f"stage {self.index}: forward of micro-batch {mb} after {store.current} "
                f"updates, the schedule analysis says {v.forward_base}"
            )
        x_in: Payload
        if isinstance(x, Tensor):
            x_in = (
                x.detach().requires_grad_(True) if x.is_floating_point() and self.index > 0 else x
            )
            shape_key: tuple[Any, ...] = (tuple(x.shape), x.dtype)
        else:
            x_in = mapped(
                x,
                lambda t: (
                    t.detach().requires_grad_(True)
                    if t.is_floating_point() and self.index > 0
                    else t
                ),
            )
            shape_key = tuple((tuple(t.shape), t.dtype) for t in parts(x))
        s = self.distance(mb)
        sources = store.sources(v.forward_version, mb)
        direct = self._on_parameters(v, s)
        amp_dtype = self.precision.dtype
        recast = amp_dtype is not None and not direct
        held = s > 0 and self.predicted_backward
        # A predicted forward runs on Ŵ in the stage's prediction buffer; what the graph
        # saves of it is re-pointed at the live weights, which the backward is to read, or
        # the buffer becomes the live weights at the next update (_buffer_becomes_live).
        predicted = s > 0 and not held
        repoint = predicted and not self._reads_buffer
        # Activation bytes are counted by a saved-tensor hook on the first forward of each
        # input shape, then reused (the hook runs on every pass only to re-cast under amp
        # and to re-point a predicted forward's saved weights).
        by_shape = self.memory_count.by_shape
        hooked = recast or repoint or shape_key not in by_shape
        saves = ForwardSaves(sources, amp_dtype if recast else None) if hooked else None
        with (
            self.random.stream(),
            torch.autograd.graph.saved_tensors_hooks(saves.pack, unpack)
            if saves is not None
            else nullcontext(),
            self.precision.autocast(),
        ):
            live = sources
            if held:
                # Ŵ in its own storage: the graph keeps it, so the backward reads it too.
                sources = self._held_prediction(s)
                if saves is not None:
                    saves.add_weights(sources)
            elif repoint:
                sources = self._write_prediction(s)
                assert saves is not None  # a re-pointing forward is always hooked
                saves.repoint(sources, live)
            elif predicted:
                sources = self._write_prediction(s)
                store.on_buffer[mb] = store.current
                if saves is not None:
                    saves.add_weights(sources)
            if s > 0 and self.closure is not None:
                self.closure.forward(self.index, mb, s, sources, self._params)
            weights: list[Tensor] | None = None
            if not direct:
                # a held Ŵ is this forward's own; other storage is read by many forwards
                weights = (
                    [alias(p, src) for p, src in zip(self._params, sources, strict=True)]
                    if held
                    else store.aliases(sources, mb)
                )
                if saves is not None and not store.leaf_grads:
                    for w, src, now in zip(weights, sources, live, strict=True):
                        # a saved cast is re-cast at backward from the weights it is to read
                        saves.aliases[w.grad_fn] = src if held else now
            units: KeptUnits | None = None
            out: Payload
            steps = None
            if self.recompute is not None:
                region = (
                    RegionWeights(None)
                    if direct
                    else self.recompute.hold_prediction(sources, recast)
                    if predicted
                    else RegionWeights(sources)
                )
                if region.held:
                    self.memory_count.hold(mb, self.recompute.held_bytes)
                keep = saves.keep if saves is not None else None
                steps = self.recompute.steps(weights, region, keep)
            if self._split and weights is None and self._unit_params is not None:
                out, units = run_units_kept(
                    self.module,
                    x_in,
                    self._unit_params,
                    stage=self.index,
                    failure=self._failure,
                    steps=steps,
                )
            elif steps is not None:
                out = self._run_recomputed(steps, x_in)
            elif weights is None and self.closure is None and self._in_product is not None:
                with self._in_product:
                    out = self._run_units(weights, x_in)
            else:
                out = self._run_units(weights, x_in)
            if self.is_last:
                if target is None:
                    raise RuntimeError(f"stage {self.index}: the last stage needs targets")
                self.correct = self.count_correct(out, target)
                loss = self.loss(out, target, f"micro-batch {mb}")
                out = token_share(loss, target, self.micro_batches, counted, self.replicas)
            elif not isinstance(out, Tensor):
                out = self._tuple_out(out)
        if self._split and shape_key not in by_shape:
            refusal = reentrant_refusal(out, self.module, self.index, self.first_unit)
            if refusal is not None:
                raise StageError(refusal)
        # a recomputed last unit's output is let go of once sent, so not counted
        releases = not self.is_last and self.recompute is not None and self.recompute.ends_stage
        if saves is not None:
            if not releases:
                for t in parts(out):
                    saves.pack(t)
            by_shape.setdefault(shape_key, saves.activation_bytes)
        if held:
            self.weights.held.add(mb)
        if units is not None:
            self._units_out[mb] = units
        self._saved[mb] = (x_in, out)
        act = saves.activation_bytes if saves is not None else by_shape[shape_key]
        self.memory_count.add_activations(mb, act)
        sent = detached(out)
        if releases:
            release_output(out, x_in)
        return sent

    def forward_eval(self, x: Payload) -> Payload:
        """Forward on the live weights without autograd (evaluation); the caller puts the
        module in eval mode."""
        self.finish_backward()
        with torch.no_grad(), self.precision.autocast():
            try:
                out: Payload = self.module(*x) if isinstance(x, tuple) else self.module(x)
            except Exception as err:
                raise StageError(self._failure(x, err)) from err
        if isinstance(out, tuple | dict) and not self.is_last:
            out = self._tuple_out(out)
        return out
