"""Per-layer profiling of a torch model into a :class:`~pipeoptim.plan.profile.Profile`.

The planner needs, for each layer in pipeline order, its forward and backward time and its
activation, parameter and optimizer-state bytes. :func:`profile_model` measures them on the
device the model will train on and under the conditions of a run (threads, busy stand-ins
for the other ranks on the machine): this module checks the request, walks the layers for
their sizes and assembles the profile; the timings are
:mod:`pipeoptim.runtime.profiling.layer_timing` and the byte counts
:mod:`pipeoptim.runtime.profiling.layer_memory`. Profiling a built-in model by name is
:mod:`pipeoptim.workloads.profiling`.

Profiling does not change the model: parameter gradients are cleared afterwards and buffers
(BatchNorm running statistics...) are restored. The layers are moved to ``device`` in place,
as ``nn.Module.to`` does.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.optimizer_families import optimizer_family
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.profile import (
    OPTIMIZER_STATE_FACTORS,
    LayerProfile,
    Profile,
    optimizer_state_factor,
)
from pipeoptim.plan.runtime_costs import RuntimeCosts
from pipeoptim.runtime.config import is_whole
from pipeoptim.runtime.host_allocator import keep_freed_memory
from pipeoptim.runtime.model.materialize import is_meta, materialize_units
from pipeoptim.runtime.model.units import InitWeights
from pipeoptim.runtime.profiling.layer_memory import (
    estimated_state_bytes,
    tensor_bytes,
    trainable_bytes,
)
from pipeoptim.runtime.profiling.layer_timing import (
    check_output,
    leaf_input,
    shaped_steps,
    streamed_steps,
    time_passes,
    time_step_and_prediction,
    timer_for,
    weight_grad_fractions,
)
from pipeoptim.runtime.stage.saved import SavedBytes

__all__ = ["profile_model"]


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


def _measure_layer(
    name: str,
    module: nn.Module,
    x: Tensor,
    *,
    family: str,
    state_factor: int,
    warmup: int,
    repeats: int,
    timer: Callable[[Callable[[], Any]], float],
    optimizer: OptimizerSpec | None = None,
) -> tuple[LayerProfile, Tensor]:
    """One layer's sizes on input ``x`` (times are filled in from whole passes); returns
    its profile and its (detached) output. With ``optimizer`` its state is measured, else
    estimated (the factor, or the shapes where the state is no multiple of the weights)."""
    params = list(module.parameters())
    out, saved = _forward_saving(name, module, x, params)
    param_bytes = sum(tensor_bytes(p) for p in params)
    trainable = trainable_bytes(module)
    state_bytes = estimated_state_bytes(module, family, state_factor)
    if optimizer is not None and trainable:
        state_bytes = time_step_and_prediction(
            params, optimizer, warmup=0, repeats=1, timer=timer
        ).state_bytes
    profile = LayerProfile(
        name=f"{name}:{type(module).__name__}",
        forward_s=0.0,
        backward_s=0.0,
        activation_bytes=tensor_bytes(out),
        saved_bytes=saved,
        param_bytes=param_bytes,
        optimizer_state_bytes=state_bytes,
        param_count=sum(p.numel() for p in params),
    )
    return profile, out.detach()


def _forward_saving(
    name: str, module: nn.Module, x: Tensor, params: Sequence[Tensor]
) -> tuple[Tensor, int]:
    """The layer's output on ``x``, and the bytes its forward saves for its backward other
    than its output (counted as the runtime's hook counts them: ``SavedBytes``). The output
    is left to whoever keeps it: the next unit that saves its input, a recomputed region
    that starts there, or the stage that sends it (``plan/kept_bytes.py``)."""
    kept: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = check_output(name, module(leaf_input(x)))
    weights = {p.untyped_storage().data_ptr() for p in params}
    counter = SavedBytes(weights | {out.untyped_storage().data_ptr()})
    for t in kept:
        counter.add(t)
    return out, counter.total


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
    init_weights: InitWeights | None = None,
    runtime: Callable[[Profile], RuntimeCosts] | None = None,
) -> Profile:
    """Measure each layer of ``layers`` (in order) on ``sample_input`` and return a Profile.

    Layers built on the meta device are profiled one at a time: each is copied, materialised
    on ``device`` with ``init_weights(index, layer)``, measured alone and dropped, so no more
    than one layer's weights are ever held (``neighbours`` is not available then).

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
    ``rmsprop``...) and ``momentum`` estimate the state bytes (see
    :func:`~pipeoptim.plan.profile.optimizer_state_factor`; ``basis-rotation``'s from the
    parameter shapes, as its state is no multiple of the weights). ``threads`` runs torch with
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
    layer by its trainable bytes. Where the step does matrix work on each weight matrix
    (``muon``'s Newton–Schulz, ``basis-rotation``'s rotations and basis refreshes), which a
    flat buffer cannot show, each layer is also charged the step and prediction on its own
    parameters' shapes less the same on them flattened
    (:func:`~pipeoptim.runtime.profiling.layer_timing.shaped_steps`). ``device`` defaults to
    the device of the first parameter, else of ``sample_input``. ``progress`` shows a tqdm bar.
    ``runtime`` measures what the runtime costs beyond the layers on this host (the
    executor's work per action, a message's: :mod:`pipeoptim.workloads.profiling` has one),
    given the layers' profile, under the same conditions (threads, neighbours) right after
    them; it becomes the profile's ``runtime_costs`` (where it fails,
    ``meta["runtime_costs_failed"]`` says why and the profile has none).
    """
    named = _named_layers(layers)
    if any(is_meta(m) for _, m in named):
        if neighbours or runtime is not None:
            raise RuntimeConfigError(
                f"neighbours={neighbours} and runtime= run copies of the whole model beside "
                f"the profile, and these layers are on the meta device (no rank holds them "
                f"all); profile them with neighbours=0 and runtime=None"
            )
        return _profile_one_at_a_time(
            named,
            sample_input,
            init_weights,
            device,
            progress,
            stream_bytes,
            dict(
                optimizer=optimizer, momentum=momentum, warmup=warmup, repeats=repeats,
                threads=threads, batch_sizes=batch_sizes, steps=steps,
            ),
        )  # fmt: skip
    if optimizer.lower() not in OPTIMIZER_STATE_FACTORS:
        raise RuntimeConfigError(
            f"unknown optimizer {optimizer!r}; the profiler knows the state size of "
            f"{', '.join(sorted(OPTIMIZER_STATE_FACTORS))}"
        )
    if not is_whole(warmup, 0):
        raise RuntimeConfigError(f"warmup must be a whole number >= 0, got {warmup!r}")
    if not is_whole(repeats, 1):
        raise RuntimeConfigError(f"repeats must be a whole number >= 1, got {repeats!r}")
    if not isinstance(sample_input, Tensor):
        raise RuntimeConfigError(
            f"sample_input must be a torch.Tensor (one batch), got {type(sample_input).__name__}"
        )
    state_factor = optimizer_state_factor(optimizer, momentum=momentum)
    if threads is not None and not is_whole(threads, None):
        raise RuntimeConfigError(f"threads must be a whole number >= 1, got {threads!r}")
    if threads is not None and threads < 1:
        raise RuntimeConfigError(f"threads must be >= 1, got {threads}; pass e.g. threads=1")
    batch = int(sample_input.shape[0]) if sample_input.dim() > 0 else 1
    if batch_sizes is None:
        halves = (batch // 2, batch // 4, batch // 8)
        sizes = sorted({b for b in halves if 2 <= b < batch}, reverse=True)
    else:
        bad: list[object] = [b for b in batch_sizes if not is_whole(b, 1, batch - 1)]
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
        if momentum is not None and optimizer_family(family).momentum_option:
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
    if target.type == "cpu":  # time the layers under the allocator a run trains with
        keep_freed_memory()
    for _, module in named:
        module.to(target)
    saved_buffers = [
        [(buf, buf.detach().clone()) for buf in module.buffers()] for _, module in named
    ]

    iterator: Any = named
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(named, desc="profiling layers", unit="layer")

    timer = timer_for(target)
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
                    family=optimizer.lower(),
                    state_factor=state_factor,
                    warmup=warmup,
                    repeats=repeats,
                    timer=timer,
                    optimizer=spec,
                )
                results.append(layer)
                trainable.append(trainable_bytes(module))
            results = time_passes(
                results, named, sample_input.to(target), sizes, warmup, repeats, timer
            )
            shares = weight_grad_fractions(
                named, sample_input.to(target), warmup=warmup, repeats=repeats, timer=timer
            )
            results = [
                dataclasses.replace(layer, weight_grad_fraction=share)
                for layer, share in zip(results, shares, strict=True)
            ]
            if spec is not None and sum(trainable) > 0:
                results = streamed_steps(
                    results, trainable, stream_bytes or sum(trainable), spec, target, timer,
                    warmup=warmup, repeats=repeats,
                )  # fmt: skip
                results = shaped_steps(
                    results, [m for _, m in named], spec, timer, warmup=warmup, repeats=repeats
                )
        if dtype_bytes == 0:
            dtype_bytes = sample_input.element_size() if sample_input.is_floating_point() else 4
        measured, runtime_problem = _runtime_costs(
            runtime,
            Profile(tuple(results), batch_size, optimizer.lower(), str(target), dtype_bytes),
        )
    finally:
        busy.close()
        torch.set_num_threads(threads_before)
        with torch.no_grad():
            for pairs in saved_buffers:
                for buf, saved in pairs:
                    buf.copy_(saved)
    meta: dict[str, Any] = {
        "source": "pipeoptim.runtime.profiling.profiler",
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
    if runtime_problem is not None:
        meta["runtime_costs_failed"] = runtime_problem
    if target.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(target)
    return Profile(
        layers=tuple(results),
        batch_size=batch_size,
        optimizer=optimizer.lower(),
        device=str(target),
        dtype_bytes=dtype_bytes,
        meta=meta,
        runtime_costs=measured,
    )


def _runtime_costs(
    measure: Callable[[Profile], RuntimeCosts] | None, layers: Profile
) -> tuple[RuntimeCosts | None, str | None]:
    """``measure(layers)``, or why it could not be taken (a host where processes cannot be
    spawned or connected: the profile is kept without it)."""
    if measure is None:
        return None, None
    try:
        return measure(layers), None
    except (RuntimeError, OSError, ValueError) as err:
        return None, f"{type(err).__name__}: {err}"


def _profile_one_at_a_time(
    named: list[tuple[str, nn.Module]],
    sample_input: Tensor,
    init_weights: InitWeights | None,
    device: str | torch.device | None,
    progress: bool,
    stream_bytes: int | None,
    options: dict[str, Any],
) -> Profile:
    """:func:`profile_model` of meta-device layers: each materialised alone, from shapes."""
    if init_weights is None:
        raise RuntimeConfigError(
            "the layers are on the meta device (shapes, no values): pass "
            "init_weights=lambda index, layer: ... so each can be materialised to be timed"
        )
    target = torch.device(device) if device is not None else sample_input.device
    modules = [m for _, m in named]
    # a step is timed streaming the largest layer's weights (never more than one layer held)
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in modules)
    iterator: Any = enumerate(named)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, total=len(named), desc="profiling layers", unit="layer")
    x = sample_input.to(target)
    layers: list[LayerProfile] = []
    alone: Profile | None = None
    for i, (name, module) in iterator:
        held = list(modules)
        held[i] = copy.deepcopy(module)
        materialize_units(held, [i], target, init_weights, seed=0)
        alone = profile_model(
            [held[i]], x, device=target, stream_bytes=stream_bytes or largest or None, **options
        )
        layers.append(dataclasses.replace(alone.layers[0], name=f"{name}:{type(module).__name__}"))
        with torch.no_grad():
            x = check_output(name, held[i](x)).detach()
        del held
    assert alone is not None
    floats = [p for m in modules for p in m.parameters() if p.is_floating_point()]
    width = floats[0].element_size() if floats else alone.dtype_bytes
    meta = {
        **alone.meta,
        "input_shape": list(sample_input.shape),
        "input_dtype": str(sample_input.dtype),
        "materialised": "one layer at a time",
    }
    return dataclasses.replace(alone, layers=tuple(layers), dtype_bytes=width, meta=meta)
