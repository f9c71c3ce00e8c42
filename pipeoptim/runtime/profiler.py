"""Per-layer profiling of a torch model into a :class:`~pipeoptim.plan.profile.Profile`.

The planner needs, for each layer in pipeline order, its forward and backward time and its
activation, parameter and optimizer-state bytes. This module measures them on the device the
model will train on: every layer runs alone on the real activations of the previous layer,
after warm-up, and the median of several repeats is kept (robust to the odd slow run). CUDA
timings use CUDA events with synchronisation; CPU timings use ``time.perf_counter``.

Profiling does not change the model: parameter gradients are cleared afterwards and buffers
(BatchNorm running statistics...) are restored. The layers are moved to ``device`` in place,
as ``nn.Module.to`` does.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.profile import (
    OPTIMIZER_STATE_FACTORS,
    LayerProfile,
    Profile,
    optimizer_state_factor,
)
from pipeoptim.runtime.placement import rank_threads

__all__ = ["profile_builtin", "profile_model"]


def _named_layers(layers: nn.Sequential | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    if isinstance(layers, nn.Sequential):
        named = list(layers.named_children())
    else:
        named = [(str(i), module) for i, module in enumerate(layers)]
    for key, module in named:
        if not isinstance(module, nn.Module):
            raise RuntimeConfigError(
                f"layer {key} is a {type(module).__name__}, not a torch.nn.Module; pass an "
                "nn.Sequential or a list of modules"
            )
    if not named:
        raise RuntimeConfigError(
            "cannot profile an empty model: pass an nn.Sequential or a list with at least one "
            "module"
        )
    return named


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
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


def _tensor_bytes(tensor: Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def _trainable_bytes(module: nn.Module) -> int:
    return sum(_tensor_bytes(p) for p in module.parameters() if p.requires_grad)


def _leaf_input(x: Tensor) -> Tensor:
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


def _time_step_and_prediction(
    params: list[nn.Parameter],
    optimizer: OptimizerSpec,
    *,
    warmup: int,
    repeats: int,
    timer: Callable[[Callable[[], Any]], float],
) -> tuple[float, float, int]:
    """Median seconds of one optimizer step and of one prediction (Ŵ written into a
    buffer, as a predicting stage does before its forward) for ``params``, and the
    optimizer state bytes after the steps. The weights are restored afterwards."""
    from pipeoptim.runtime.predict import predictor_for
    from pipeoptim.runtime.stage import make_optimizer

    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return 0.0, 0.0, 0
    saved = [p.detach().clone() for p in trainable]
    opt = make_optimizer(optimizer, trainable)
    predictor = predictor_for(opt, "optimizer")
    buffer = [torch.empty_like(p) for p in trainable]

    def predict() -> None:
        predictor.predict_into(buffer, 1)

    steps: list[float] = []
    predictions: list[float] = []
    try:
        for p in trainable:
            p.grad = torch.full_like(p, 1e-3)
        for run in range(warmup + repeats):
            step_s = timer(opt.step)
            predict_s = timer(predict)
            if run >= warmup:
                steps.append(step_s)
                predictions.append(predict_s)
        state = sum(
            _tensor_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
        )
    finally:
        predictor.close()
        with torch.no_grad():
            for p, w in zip(trainable, saved, strict=True):
                p.copy_(w)
                p.grad = None
    return statistics.median(steps), statistics.median(predictions), state


def _timed(
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


def _streamed_steps(
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
    step_s, predict_s, _ = _time_step_and_prediction(
        [flat], optimizer, warmup=max(warmup, 1), repeats=repeats, timer=timer
    )
    size = flat.numel() * flat.element_size()
    return [
        dataclasses.replace(x, update_s=step_s * b / size, predict_s=predict_s * b / size)
        for x, b in zip(layers, trainable, strict=True)
    ]


def _check_output(name: str, out: object) -> Tensor:
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
        inp = _leaf_input(x)
        for i, (name, module) in enumerate(named):
            holder: list[Tensor] = []
            seconds = timer(partial(_call_into, module, inp, holder))
            out = _check_output(name, holder[0])
            if run >= warmup:
                forward_times[i].append(seconds)
            inputs.append(inp)
            outputs.append(out)
            inp = _leaf_input(out)
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


def _weight_grad_fractions(
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
        inp = _leaf_input(x)
        for name, module in named:
            out = _check_output(name, module(inp))
            inputs.append(inp)
            outputs.append(out)
            inp = _leaf_input(out)
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


def _measure_layer(
    name: str,
    module: nn.Module,
    x: Tensor,
    *,
    state_factor: int,
    warmup: int,
    repeats: int,
    timer: Callable[[Callable[[], Any]], float],
    optimizer: OptimizerSpec | None = None,
) -> tuple[LayerProfile, Tensor]:
    """One layer's sizes on input ``x`` (times are filled in from whole passes); returns
    its profile and its (detached) output. With ``optimizer`` its state is measured."""
    params = list(module.parameters())
    out = _check_output(name, module(_leaf_input(x)))
    param_bytes = sum(_tensor_bytes(p) for p in params)
    trainable_bytes = _trainable_bytes(module)
    state_bytes = state_factor * trainable_bytes
    if optimizer is not None and trainable_bytes:
        _, _, state_bytes = _time_step_and_prediction(
            params, optimizer, warmup=0, repeats=1, timer=timer
        )
    profile = LayerProfile(
        name=f"{name}:{type(module).__name__}",
        forward_s=0.0,
        backward_s=0.0,
        activation_bytes=_tensor_bytes(out),
        param_bytes=param_bytes,
        optimizer_state_bytes=state_bytes,
        param_count=sum(p.numel() for p in params),
    )
    return profile, out.detach()


def _keep_busy(
    layers: list[nn.Module], sample: Tensor, threads: int, ready: Any, stop: Any
) -> None:
    """A stand-in for another pipeline rank: train steps on a copy of the model until
    ``stop`` is set, so the profile sees the memory bandwidth and caches a run shares."""
    torch.set_num_threads(threads)
    model = nn.Sequential(*layers)
    ready.set()
    while not stop.is_set():
        out = model(sample)
        if isinstance(out, Tensor) and out.requires_grad:
            torch.autograd.backward(out.float().sum())
        for p in model.parameters():
            p.grad = None


class _Neighbours:
    """``count`` processes running :func:`_keep_busy` while the profile is taken."""

    def __init__(self, layers: Sequence[nn.Module], sample: Tensor, count: int, threads: int):
        self.procs: list[Any] = []
        self.started = 0
        self.problem: str | None = None
        if count < 1:
            return
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self.stop = context.Event()
        copies = [copy.deepcopy(m).cpu() for m in layers]
        try:
            for _ in range(count):
                ready = context.Event()
                proc = context.Process(
                    target=_keep_busy,
                    args=(copies, sample.cpu(), threads, ready, self.stop),
                    daemon=True,
                )
                proc.start()
                self.procs.append(proc)
                deadline = time.monotonic() + 120
                while not ready.wait(timeout=0.1):
                    if not proc.is_alive():
                        raise RuntimeError(f"a busy neighbour exited with code {proc.exitcode}")
                    if time.monotonic() > deadline:
                        raise RuntimeError("a busy neighbour did not start within 120 s")
            self.started = count
        except Exception as err:  # e.g. a model that cannot be pickled to a new process
            self.problem = f"{type(err).__name__}: {err}"
            self.close()

    def close(self) -> None:
        if self.procs:
            self.stop.set()
            for proc in self.procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
        self.procs = []


def profile_model(
    layers: nn.Sequential | Sequence[nn.Module],
    sample_input: Tensor,
    *,
    optimizer: str = "sgd",
    momentum: bool | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device: str | torch.device | None = None,
    progress: bool = False,
    threads: int | None = None,
    batch_sizes: Sequence[int] | None = None,
    steps: bool = True,
    neighbours: int = 0,
    stream_bytes: int | None = None,
) -> Profile:
    """Measure each layer of ``layers`` (in order) on ``sample_input`` and return a Profile.

    ``sample_input`` is one batch (its first dimension is the batch size recorded in the
    profile; use the mini-batch size the pipeline will run). Per layer: the forward (with
    autograd recording, as in training) and ``torch.autograd.backward`` of its output with a
    ones gradient are each timed ``warmup + repeats`` times and the median of the last
    ``repeats`` is kept. The same is done at the smaller ``batch_sizes`` (default: a half,
    a quarter and an eighth of the batch), and a line through the times gives the part of
    each time that does not shrink with the batch, so micro-batch costs are not taken as a
    plain fraction.
    At the full batch, further passes split every backward into its input-gradient and
    weight-gradient parts (as zero-bubble schedules run them) and record the weight part's
    share (``LayerProfile.weight_grad_fraction``).
    With ``steps`` the layer's optimizer step and its weight prediction are timed and its
    optimizer state is measured; otherwise ``optimizer`` (``sgd``, ``adam``, ``adamw``,
    ``rmsprop``) and ``momentum`` estimate the state bytes (see
    :func:`~pipeoptim.plan.profile.optimizer_state_factor`). ``threads`` runs torch with
    that many CPU threads while measuring (a pipeline rank gets ``cores // ranks``; the
    profile records the count). ``neighbours`` (CPU) starts that many processes training a
    copy of the model meanwhile, as the other ranks of a pipeline on this machine would:
    they share its memory bandwidth and caches, which slows steps and predictions most.
    They are spawned, so a script that asks for them needs the usual ``if __name__ ==
    "__main__":`` guard; a model that cannot be sent to them is profiled without them and
    ``meta["neighbours_failed"]`` says why.
    A step and a prediction stream the weights through memory, and timed one small layer
    at a time they run from cache; so they are timed once on ``stream_bytes`` of weights
    (default: the model's trainable bytes; about one stage's is best) and charged to each
    layer by its trainable bytes. ``device`` defaults to the device of the first
    parameter, else of ``sample_input``. ``progress`` shows a tqdm bar.
    """
    named = _named_layers(layers)
    if optimizer.lower() not in OPTIMIZER_STATE_FACTORS:
        raise RuntimeConfigError(
            f"unknown optimizer {optimizer!r}; the profiler knows the state size of "
            f"{', '.join(sorted(OPTIMIZER_STATE_FACTORS))}"
        )
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise RuntimeConfigError(f"warmup must be a whole number >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise RuntimeConfigError(f"repeats must be a whole number >= 1, got {repeats!r}")
    if not isinstance(sample_input, Tensor):
        raise RuntimeConfigError(
            f"sample_input must be a torch.Tensor (one batch), got {type(sample_input).__name__}"
        )
    state_factor = optimizer_state_factor(optimizer, momentum=momentum)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
        raise RuntimeConfigError(f"threads must be a whole number >= 1, got {threads!r}")
    if threads is not None and threads < 1:
        raise RuntimeConfigError(f"threads must be >= 1, got {threads}; pass e.g. threads=1")
    batch = int(sample_input.shape[0]) if sample_input.dim() > 0 else 1
    if batch_sizes is None:
        halves = (batch // 2, batch // 4, batch // 8)
        sizes = sorted({b for b in halves if 2 <= b < batch}, reverse=True)
    else:
        bad: list[object] = [
            b
            for b in batch_sizes
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b < batch
        ]
        if bad:
            raise RuntimeConfigError(
                f"batch_sizes must be whole numbers from 1 to {batch - 1} (below the sample "
                f"batch of {batch}), got {list(batch_sizes)!r}"
            )
        sizes = sorted(set(batch_sizes), reverse=True)
    spec: OptimizerSpec | None = None
    if steps:
        family = optimizer.lower()
        options: dict[str, Any] = {}
        if momentum is not None and family in ("sgd", "rmsprop"):
            options["momentum"] = 0.9 if momentum else 0.0
        spec = OptimizerSpec(family, 1e-3, options)

    if device is None:
        first = next((p for _, m in named for p in m.parameters()), None)
        target = first.device if first is not None else sample_input.device
    else:
        target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeConfigError(
            f"device {str(target)!r} was asked for but CUDA is not available; pass device='cpu'"
        )
    for _, module in named:
        module.to(target)
    saved_buffers = [
        [(buf, buf.detach().clone()) for buf in module.buffers()] for _, module in named
    ]

    iterator: Any = named
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(named, desc="profiling layers", unit="layer")

    timer = _timer(target)
    x = sample_input.to(target)
    batch_size = batch
    results: list[LayerProfile] = []
    dtype_bytes = 0
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    measured_threads = torch.get_num_threads()
    trainable: list[int] = []  # trainable parameter bytes per layer
    busy = _Neighbours(
        [m for _, m in named],
        sample_input,
        neighbours if target.type == "cpu" else 0,
        measured_threads,
    )
    try:
        with torch.enable_grad():
            for name, module in iterator:
                if dtype_bytes == 0:
                    floats = [p for p in module.parameters() if p.is_floating_point()]
                    if floats:
                        dtype_bytes = floats[0].element_size()
                layer, x = _measure_layer(
                    name,
                    module,
                    x,
                    state_factor=state_factor,
                    warmup=warmup,
                    repeats=repeats,
                    timer=timer,
                    optimizer=spec,
                )
                results.append(layer)
                trainable.append(_trainable_bytes(module))
            results = _timed(results, named, sample_input.to(target), sizes, warmup, repeats, timer)
            shares = _weight_grad_fractions(
                named, sample_input.to(target), warmup=warmup, repeats=repeats, timer=timer
            )
            results = [
                dataclasses.replace(layer, weight_grad_fraction=share)
                for layer, share in zip(results, shares, strict=True)
            ]
            if spec is not None and sum(trainable) > 0:
                results = _streamed_steps(
                    results, trainable, stream_bytes or sum(trainable), spec, target, timer,
                    warmup=warmup, repeats=repeats,
                )  # fmt: skip
    finally:
        busy.close()
        torch.set_num_threads(threads_before)
        with torch.no_grad():
            for pairs in saved_buffers:
                for buf, saved in pairs:
                    buf.copy_(saved)
    if dtype_bytes == 0:
        dtype_bytes = sample_input.element_size() if sample_input.is_floating_point() else 4

    meta: dict[str, Any] = {
        "source": "pipeoptim.runtime.profiler",
        "torch_version": torch.__version__,
        "timer": "cuda_event" if target.type == "cuda" else "perf_counter",
        "statistic": "median",
        "warmup": warmup,
        "repeats": repeats,
        "input_shape": list(sample_input.shape),
        "input_dtype": str(sample_input.dtype),
        "momentum": momentum,
        "threads": measured_threads,
        "batch_sizes": [batch, *sizes],
        "steps_measured": steps,
        "neighbours": busy.started,
        "weight_grad_fraction": "measured",
    }
    if busy.problem is not None:
        meta["neighbours_failed"] = busy.problem
    if target.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(target)
    return Profile(
        layers=tuple(results),
        batch_size=batch_size,
        optimizer=optimizer.lower(),
        device=str(target),
        dtype_bytes=dtype_bytes,
        meta=meta,
    )


def profile_builtin(
    model: str,
    *,
    batch_size: int = 64,
    optimizer: str = "sgd",
    repeats: int = 5,
    device: str | None = None,
    progress: bool = False,
    seed: int = 0,
    threads: int | None = None,
    ranks: int | None = None,
) -> Profile:
    """Profile a built-in model (or ``module:factory``) on a batch of its own training data.

    The profile's ``meta["model"]`` records the name, so a plan made from it names the
    model ``pipeoptim train --plan`` should build. ``ranks`` is how many pipeline ranks
    will share this machine: on CPU each gets ``cores // ranks`` threads (what ``pipeoptim
    train --transport dist`` gives them), and the profile is taken with as many, unless
    ``threads`` says otherwise; as many of the other ranks as can run at once (one per
    further core) are stood in for by busy processes training a copy of the model.
    """
    from pipeoptim.runtime.models import build_model

    if batch_size < 1:
        raise RuntimeConfigError(f"--batch-size must be at least 1 (got {batch_size})")
    layers, data = build_model(model, seed)
    sample = data.train_x[: min(batch_size, len(data.train_x))]
    if len(sample) < batch_size:
        raise RuntimeConfigError(
            f"model {model!r} has {len(data.train_x)} training samples, fewer than "
            f"--batch-size {batch_size}; use a smaller batch"
        )
    if ranks is not None and ranks < 1:
        raise RuntimeConfigError(f"--ranks must be at least 1 (got {ranks})")
    on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    if threads is None and ranks is not None and on_cpu:
        threads = rank_threads(ranks)
    profile = profile_model(
        layers,
        sample,
        optimizer=optimizer,
        repeats=repeats,
        device=device,
        progress=progress,
        threads=threads,
        neighbours=_neighbours(ranks) if on_cpu else 0,
        stream_bytes=_stage_bytes(layers, ranks),
    )
    meta = {**profile.meta, "model": model, "ranks": ranks}
    return dataclasses.replace(profile, meta=meta)


def _stage_bytes(layers: Sequence[nn.Module], ranks: int | None) -> int | None:
    """About one stage's trainable bytes when the model is split over ``ranks``."""
    total = sum(_trainable_bytes(m) for m in layers)
    return max(1, total // ranks) if ranks and total else None


def _neighbours(ranks: int | None) -> int:
    """Busy processes standing in for the other ranks: those that can run alongside this
    one at once (more than the cores only take turns)."""
    if not ranks:
        return 0
    return max(0, min(ranks, os.cpu_count() or 1) - 1)
