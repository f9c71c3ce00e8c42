"""Timing the layers of a model: forward and backward passes, the backward's split into
input and weight gradients, the fixed per-call part, the optimizer step and the prediction.

The profiler (:mod:`pipeoptim.runtime.profiling.profiler`) measures on the device the model
will train on. Every layer runs within whole passes on the real activations of the previous
layer, after warm-up, and the median of several repeats is kept (robust to the odd slow
run). CUDA timings use CUDA events with synchronisation; CPU timings use
``time.perf_counter``. Everything here is a measurement of time; what the layers occupy is
:mod:`pipeoptim.runtime.profiling.layer_memory`."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.optimizer_families import FAMILIES, optimizer_family
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.profile import LayerProfile
from pipeoptim.runtime.profiling.layer_memory import optimizer_state_bytes

__all__ = [
    "SHAPED_STEPS",
    "StepTiming",
    "check_output",
    "leaf_input",
    "shaped_steps",
    "streamed_steps",
    "time_passes",
    "time_step_and_prediction",
    "timer_for",
    "weight_grad_fractions",
]


def timer_for(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """A function that runs a callable once and returns its duration in seconds."""
    if device.type == "cuda":

        def cuda_time(fn: Callable[[], Any]) -> float:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return float(start.elapsed_time(end)) / 1e3

        return cuda_time

    def wall_time(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return wall_time


def leaf_input(x: Tensor) -> Tensor:
    leaf = x.detach()
    if leaf.is_floating_point() or leaf.is_complex():
        leaf.requires_grad_(True)
    return leaf


def _call_into(fn: Callable[[Tensor], Tensor], inp: Tensor, holder: list[Tensor]) -> None:
    holder.append(fn(inp))


def _fixed_part(sizes: Sequence[int], times: Sequence[float]) -> float:
    """The intercept of a least-squares line through (batch size, time), kept within
    [0, time at the largest size]: the per-call cost that does not shrink with the batch."""
    if len(sizes) < 2:
        return 0.0
    mean_b, mean_t = statistics.fmean(sizes), statistics.fmean(times)
    spread = sum((b - mean_b) ** 2 for b in sizes)
    if spread == 0:
        return 0.0
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes, times, strict=True)) / spread
    largest = times[sizes.index(max(sizes))]
    return min(max(mean_t - slope * mean_b, 0.0), largest)


class StepTiming(NamedTuple):
    """What :func:`time_step_and_prediction` measured for one set of parameters."""

    step_s: float
    """Median seconds of one optimizer step."""
    predict_s: float
    """Median seconds of one prediction write (Ŵ into a buffer, as a predicting stage does
    before its forward): for a predictor that keeps Δ, a write from the kept Δ."""
    state_bytes: int
    """Optimizer state bytes after the steps."""
    prediction_setup_s: float | None = None
    """Seconds to compute the kept Δ once per update: the median first prediction after a
    step less the median second one (never below 0). None: the predictor keeps no Δ (each
    write forms its own, in :attr:`predict_s`)."""

    def added_to(self, layer: LayerProfile, base: StepTiming) -> LayerProfile:
        """``layer`` with its update, prediction write and per-update setup each raised by
        what this timing adds over ``base`` (never below 0): how a matrix part, or another
        optimizer's, goes on top of what the layer already measured. The setup stays None
        where neither the layer nor this timing measured one (nothing kept)."""
        setup = layer.prediction_setup_s
        if setup is not None or self.prediction_setup_s is not None:
            extra = (self.prediction_setup_s or 0.0) - (base.prediction_setup_s or 0.0)
            setup = (setup or 0.0) + max(0.0, extra)
        return dataclasses.replace(
            layer,
            update_s=layer.update_s + max(0.0, self.step_s - base.step_s),
            predict_s=layer.predict_s + max(0.0, self.predict_s - base.predict_s),
            prediction_setup_s=setup,
        )


def time_step_and_prediction(
    params: list[nn.Parameter],
    optimizer: OptimizerSpec,
    *,
    warmup: int,
    repeats: int,
    timer: Callable[[Callable[[], Any]], float],
) -> StepTiming:
    """Median seconds of one optimizer step and of one prediction (Ŵ written into a
    buffer, as a predicting stage does before its forward) for ``params``, and the
    optimizer state bytes after the steps. The weights are restored afterwards.

    A predictor that keeps Δ (``keeps_deltas``: Muon's Newton–Schulz, basis rotation's
    rotations) forms it once per update, at the end of the update in the runtime
    (``Stage._prepare_deltas``): after each step the first prediction (Δ and the write)
    and a second one (the write) are timed, and their difference is the per-update
    :attr:`StepTiming.prediction_setup_s`.

    An optimizer whose step cost repeats over a period of steps (``cost_period``:
    ``basis-rotation`` refreshes its basis once every ``precondition_frequency``) is timed
    over whole periods after at least one warm-up step (its first step's
    eigendecomposition happens once per run): the step's time is then the median over
    the periods of the mean step, so the refresh is charged at its share."""
    from pipeoptim.runtime.optim.predict import predictor_for
    from pipeoptim.runtime.optim.update import make_optimizer

    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return StepTiming(0.0, 0.0, 0)
    saved = [p.detach().clone() for p in trainable]
    opt = make_optimizer(optimizer, trainable)
    predictor = predictor_for(opt, "optimizer")
    # a predictor writes in the optimizer's param-group order (Muon's matrices first)
    buffer = [torch.empty_like(p) for g in opt.param_groups for p in g["params"]]

    def predict() -> None:
        predictor.predict_into(buffer, 1)

    period = max(1, int(getattr(opt, "cost_period", 1)))
    if period > 1:
        warmup = max(warmup, 1)
        repeats = period * max(1, repeats // period)
    steps: list[float] = []
    predictions: list[float] = []
    writes: list[float] = []
    try:
        for p in trainable:
            p.grad = torch.full_like(p, 1e-3)
        for run in range(warmup + repeats):
            step_s = timer(opt.step)
            kept = predictor.kept_computations
            predict_s = timer(predict)
            # where Δ was formed and kept, a second write reads it: the write alone
            splits = predictor.kept_computations != kept
            write_s = timer(predict) if splits else predict_s
            if run >= warmup:
                steps.append(step_s)
                predictions.append(predict_s)
                writes.append(write_s)
        state = optimizer_state_bytes(opt)
        if period > 1:  # one mean per period: each holds one refresh
            steps = [statistics.fmean(steps[i : i + period]) for i in range(0, repeats, period)]
    finally:
        predictor.close()
        with torch.no_grad():
            for p, w in zip(trainable, saved, strict=True):
                p.copy_(w)
                p.grad = None
    if predictor.kept_computations == 0:  # nothing kept: every write costs alike
        return StepTiming(statistics.median(steps), statistics.median(predictions), state)
    write = statistics.median(writes)
    setup = max(0.0, statistics.median(predictions) - write)
    return StepTiming(statistics.median(steps), write, state, setup)


def time_passes(
    layers: list[LayerProfile],
    named: Sequence[tuple[str, nn.Module]],
    x: Tensor,
    sizes: Sequence[int],
    warmup: int,
    repeats: int,
    timer: Callable[[Callable[[], Any]], float],
) -> list[LayerProfile]:
    """``layers`` with their pass times at the batch of ``x`` and the fixed parts fitted
    through the times at ``sizes`` too (sizes a layer cannot run, e.g. BatchNorm on one
    sample, end the fit there)."""
    forward, backward = _pass_times(named, x, warmup=warmup, repeats=repeats, timer=timer)
    points = [(len(x) if x.dim() > 0 else 1, forward, backward)]
    for b in sizes if x.dim() > 0 else ():
        try:
            points.append(
                (b, *_pass_times(named, x[:b], warmup=warmup, repeats=repeats, timer=timer))
            )
        except (RuntimeError, ValueError):
            for _, module in named:
                for p in module.parameters():
                    p.grad = None
            break
    batches = [b for b, _, _ in points]
    out = []
    for i, layer in enumerate(layers):
        f = [times[i] for _, times, _ in points]
        g = [times[i] for _, _, times in points]
        out.append(
            dataclasses.replace(
                layer,
                forward_s=forward[i],
                backward_s=backward[i],
                forward_fixed_s=_fixed_part(batches, f),
                backward_fixed_s=_fixed_part(batches, g),
            )
        )
    return out


def streamed_steps(
    layers: list[LayerProfile],
    trainable: Sequence[int],
    stream_bytes: int,
    optimizer: OptimizerSpec,
    device: torch.device,
    timer: Callable[[Callable[[], Any]], float],
    *,
    warmup: int,
    repeats: int,
) -> list[LayerProfile]:
    """``layers`` with update and prediction times from one step and one prediction over
    ``stream_bytes`` of weights, per byte times each layer's trainable bytes."""
    flat = nn.Parameter(torch.zeros(max(1, stream_bytes // 4), device=device))
    timed = time_step_and_prediction(
        [flat], optimizer, warmup=max(warmup, 1), repeats=repeats, timer=timer
    )
    size = flat.numel() * flat.element_size()
    setup = timed.prediction_setup_s
    return [
        dataclasses.replace(
            x,
            update_s=timed.step_s * b / size,
            predict_s=timed.predict_s * b / size,
            prediction_setup_s=None if setup is None else setup * b / size,
        )
        for x, b in zip(layers, trainable, strict=True)
    ]


SHAPED_STEPS = frozenset(name for name, f in FAMILIES.items() if f.shaped_step)
"""Optimizer families whose step does matrix work on each 2-D parameter (Muon's
Newton–Schulz, Basis Rotation's rotations and basis refreshes): a flat buffer, which
:func:`streamed_steps` times, runs only their element-wise part."""


def shaped_steps(
    layers: list[LayerProfile],
    modules: Sequence[nn.Module],
    optimizer: OptimizerSpec,
    timer: Callable[[Callable[[], Any]], float],
    *,
    warmup: int,
    repeats: int,
) -> list[LayerProfile]:
    """``layers`` with the matrix part of the update and prediction added, for the
    families whose step cost follows the shapes (``shaped_step``; the others are returned
    as they are): per layer with a trainable matrix, the step (prediction) on its own
    parameters' shapes less the same on copies of them flattened to vectors, never below 0.
    Both run from cache, so the difference is the matrix work; the streamed per-byte time
    stays the element-wise part."""
    if not optimizer_family(optimizer.family).shaped_step:
        return list(layers)
    out = []
    for layer, module in zip(layers, modules, strict=True):
        params = [p for p in module.parameters() if p.requires_grad]
        if not any(p.dim() == 2 for p in params):
            out.append(layer)
            continue
        flat = [nn.Parameter(p.detach().reshape(-1).clone()) for p in params]
        timed = partial(
            time_step_and_prediction,
            optimizer=optimizer,
            warmup=max(warmup, 1),
            repeats=repeats,
            timer=timer,
        )
        out.append(timed(params).added_to(layer, timed(flat)))
    return out


def check_output(name: str, out: object) -> Tensor:
    if not isinstance(out, Tensor):
        raise RuntimeConfigError(
            f"layer {name} returned a {type(out).__name__}; the profiler handles layers "
            "that map one tensor to one tensor: wrap the layer so it returns a tensor"
        )
    return out


def _pass_times(
    named: Sequence[tuple[str, nn.Module]],
    x: Tensor,
    *,
    warmup: int,
    repeats: int,
    timer: Callable[[Callable[[], Any]], float],
) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds of every layer, timed within whole passes.

    Each pass runs every layer's forward in order, then every backward in reverse, with
    the real gradients: a layer meets its weights and inputs as cold as in training, not
    warm from running alone again and again.
    """
    count = len(named)
    forward_times: list[list[float]] = [[] for _ in range(count)]
    backward_times: list[list[float]] = [[] for _ in range(count)]
    params = [p for _, m in named for p in m.parameters()]
    for run in range(warmup + repeats):
        inputs: list[Tensor] = []
        outputs: list[Tensor] = []
        inp = leaf_input(x)
        for i, (name, module) in enumerate(named):
            holder: list[Tensor] = []
            seconds = timer(partial(_call_into, module, inp, holder))
            out = check_output(name, holder[0])
            if run >= warmup:
                forward_times[i].append(seconds)
            inputs.append(inp)
            outputs.append(out)
            inp = leaf_input(out)
        grad: Tensor | None = torch.ones_like(outputs[-1])
        for i in reversed(range(count)):
            seconds = 0.0
            if outputs[i].requires_grad:
                if grad is None or grad.shape != outputs[i].shape:
                    grad = torch.ones_like(outputs[i])
                seconds = timer(partial(torch.autograd.backward, outputs[i], grad))
            if run >= warmup:
                backward_times[i].append(seconds)
            grad = inputs[i].grad if inputs[i].requires_grad else None
        for p in params:
            p.grad = None
    return (
        [statistics.median(t) for t in forward_times],
        [statistics.median(t) for t in backward_times],
    )


def weight_grad_fractions(
    named: Sequence[tuple[str, nn.Module]],
    x: Tensor,
    *,
    warmup: int,
    repeats: int,
    timer: Callable[[Callable[[], Any]], float],
) -> list[float]:
    """Every layer's share of its backward that computes the weight gradient, timed within
    whole passes as :func:`_pass_times` times the backward, but split the way a
    zero-bubble schedule runs it: per layer (last first) the input gradient I alone
    (``torch.autograd.grad`` for the input, keeping the graph), then the weight gradient W
    alone (for the trainable parameters). The share is median W / (median I + median W);
    0 for a layer without trainable parameters, 1 for one whose input takes no gradient
    (e.g. an embedding of token ids)."""
    count = len(named)
    input_times: list[list[float]] = [[] for _ in range(count)]
    weight_times: list[list[float]] = [[] for _ in range(count)]
    trainable = [[p for p in m.parameters() if p.requires_grad] for _, m in named]
    for run in range(warmup + repeats):
        inputs: list[Tensor] = []
        outputs: list[Tensor] = []
        inp = leaf_input(x)
        for name, module in named:
            out = check_output(name, module(inp))
            inputs.append(inp)
            outputs.append(out)
            inp = leaf_input(out)
        grad: Tensor | None = None
        for i in reversed(range(count)):
            out, params = outputs[i], trainable[i]
            wants_input = inputs[i].requires_grad
            i_s = w_s = 0.0
            next_grad: Tensor | None = None
            if out.requires_grad:
                if grad is None or grad.shape != out.shape:
                    grad = torch.ones_like(out)
                if wants_input:
                    found: list[tuple[Tensor | None, ...]] = []
                    i_s = timer(
                        partial(
                            _call_into_tuple,
                            partial(
                                torch.autograd.grad,
                                out,
                                [inputs[i]],
                                grad,
                                retain_graph=bool(params),
                                allow_unused=True,
                            ),
                            found,
                        )
                    )
                    next_grad = found[0][0]
                if params:
                    w_s = timer(partial(torch.autograd.grad, out, params, grad, allow_unused=True))
            if run >= warmup:
                input_times[i].append(i_s)
                weight_times[i].append(w_s)
            grad = next_grad
    shares = []
    for i in range(count):
        if not trainable[i]:
            shares.append(0.0)
            continue
        i_s, w_s = statistics.median(input_times[i]), statistics.median(weight_times[i])
        shares.append(min(1.0, w_s / (i_s + w_s)) if i_s + w_s > 0 else 0.5)
    return shares


def _call_into_tuple(fn: Callable[[], tuple[Tensor | None, ...]], holder: list[Any]) -> None:
    holder.append(fn())
