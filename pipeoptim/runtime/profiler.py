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

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.profile import (
    OPTIMIZER_STATE_FACTORS,
    LayerProfile,
    Profile,
    optimizer_state_factor,
)

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


def _leaf_input(x: Tensor) -> Tensor:
    leaf = x.detach()
    if leaf.is_floating_point() or leaf.is_complex():
        leaf.requires_grad_(True)
    return leaf


def _call_into(fn: Callable[[Tensor], Tensor], inp: Tensor, holder: list[Tensor]) -> None:
    holder.append(fn(inp))


def _measure_layer(
    name: str,
    module: nn.Module,
    x: Tensor,
    *,
    state_factor: int,
    warmup: int,
    repeats: int,
    timer: Callable[[Callable[[], Any]], float],
) -> tuple[LayerProfile, Tensor]:
    """Time one layer on input ``x``; returns its profile and its (detached) output."""
    params = list(module.parameters())

    def clear_grads() -> None:
        for p in params:
            p.grad = None

    def forward(inp: Tensor) -> Tensor:
        out = module(inp)
        if not isinstance(out, Tensor):
            raise RuntimeConfigError(
                f"layer {name} returned a {type(out).__name__}; the profiler handles layers "
                "that map one tensor to one tensor: wrap the layer so it returns a tensor"
            )
        return out

    out = forward(_leaf_input(x))
    needs_backward = out.requires_grad
    grad = torch.ones_like(out) if needs_backward else None

    forward_times: list[float] = []
    backward_times: list[float] = []
    for run in range(warmup + repeats):
        inp = _leaf_input(x)
        holder: list[Tensor] = []
        forward_s = timer(partial(_call_into, forward, inp, holder))
        backward_s = 0.0
        if needs_backward:
            clear_grads()
            backward_s = timer(partial(torch.autograd.backward, holder[0], grad))
        if run >= warmup:
            forward_times.append(forward_s)
            backward_times.append(backward_s)
    clear_grads()

    param_bytes = sum(_tensor_bytes(p) for p in params)
    trainable_bytes = sum(_tensor_bytes(p) for p in params if p.requires_grad)
    profile = LayerProfile(
        name=f"{name}:{type(module).__name__}",
        forward_s=statistics.median(forward_times),
        backward_s=statistics.median(backward_times),
        activation_bytes=_tensor_bytes(out),
        param_bytes=param_bytes,
        optimizer_state_bytes=state_factor * trainable_bytes,
        param_count=sum(p.numel() for p in params),
    )
    return profile, out.detach()


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
) -> Profile:
    """Measure each layer of ``layers`` (in order) on ``sample_input`` and return a Profile.

    ``sample_input`` is one batch (its first dimension is the batch size recorded in the
    profile; use the micro-batch size the pipeline will run). Per layer: the forward (with
    autograd recording, as in training) and ``torch.autograd.backward`` of its output with a
    ones gradient are each timed ``warmup + repeats`` times and the median of the last
    ``repeats`` is kept. ``optimizer`` (``sgd``, ``adam``, ``adamw``, ``rmsprop``) and
    ``momentum`` set the optimizer-state bytes (see
    :func:`~pipeoptim.plan.profile.optimizer_state_factor`). ``device`` defaults to the
    device of the first parameter, else of ``sample_input``. ``progress`` shows a tqdm bar.
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
    batch_size = int(sample_input.shape[0]) if sample_input.dim() > 0 else 1
    results: list[LayerProfile] = []
    dtype_bytes = 0
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
                )
                results.append(layer)
    finally:
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
    }
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
) -> Profile:
    """Profile a built-in model (or ``module:factory``) on a batch of its own training data.

    The profile's ``meta["model"]`` records the name, so a plan made from it names the
    model ``pipeoptim train --plan`` should build.
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
    profile = profile_model(
        layers,
        sample,
        optimizer=optimizer,
        repeats=repeats,
        device=device,
        progress=progress,
    )
    return dataclasses.replace(profile, meta={**profile.meta, "model": model})
