"""The model, the runs and the tolerances of ``benchmarks/gpu_check.py``.

The model is an MLP of ``layers`` units (``layers - 1`` of Linear(width) + Tanh, then a
Linear(width, 10) head) on a learnable task (each label the arg-max of a fixed random
projection of its input), so a few SGD steps move the loss by far more than rounding does.
Every run of one method starts from the same weights and reads the same batches.

The loss tolerance (:func:`loss_tolerance`) is derived from the number format: a dot product
of length n computed in a format of unit round-off u is off by at most
γ(n) = n·u / (1 − n·u) relatively (Higham, *Accuracy and Stability of Numerical
Algorithms*, §3.1); a forward of the MLP chains one such product per layer and the loss's
sum over the 10 classes, so to first order its relative error is at most the sum of the
layers' γ(fan-in) plus γ(10). Under bf16 autocast each product's two operands are first
rounded to bf16 (u = 2⁻⁸), which adds 2·u_bf16 per layer. Step t's loss is computed on
weights that t updates have each moved with gradients of that accuracy, so its bound is
(t + 1) times one forward's. Two runs in fp32 (the device's and the CPU's) are each within
the bound of the exact loss, so they agree within twice it; the reference is the same run
in float64 on the CPU, whose own error (u = 2⁻⁵³) is negligible beside fp32's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

CLASSES = 10
LR = 0.05
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp64": 2.0**-53}


@dataclass(frozen=True)
class Size:
    """The sizes of every run of the check."""

    width: int
    layers: int
    """Units of the model (at least stages x stages per rank)."""
    batch: int
    ranks: int
    """Pipeline ranks P (a method with several stages per rank has P x v stages)."""
    steps: int
    """Mini-batches whose losses are compared."""
    timed: int
    """Mini-batches timed in a throughput run, after ``warmup`` untimed ones."""
    warmup: int


QUICK = Size(width=32, layers=8, batch=16, ranks=4, steps=3, timed=4, warmup=1)
FULL = Size(width=512, layers=16, batch=128, ranks=4, steps=4, timed=20, warmup=3)


def units(size: Size, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """The model's units, the same weights on every call."""
    torch.manual_seed(0)
    hidden: list[nn.Module] = [
        nn.Sequential(nn.Linear(size.width, size.width), nn.Tanh()) for _ in range(size.layers - 1)
    ]
    return [u.to(dtype) for u in [*hidden, nn.Linear(size.width, CLASSES)]]


def batches(size: Size, n: int, dtype: torch.dtype = torch.float32) -> list[tuple[Any, Any]]:
    """``n`` batches (input, label), the same on every call."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(size.width, CLASSES, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(size.batch, size.width, generator=g)
        out.append((x.to(dtype), (x @ teacher).argmax(dim=1)))
    return out


def gamma(n: int, u: float) -> float:
    """Higham's bound on the relative error of a length-n dot product at round-off u."""
    return n * u / (1 - n * u)


def loss_tolerance(size: Size, step: int, amp: str | None = None) -> float:
    """Relative bound on step ``step``'s loss against the exact one (module docstring)."""
    u = UNIT_ROUNDOFF["fp32"]
    per_forward = size.layers * gamma(size.width, u) + gamma(CLASSES, u)
    if amp == "bf16":
        per_forward += 2 * UNIT_ROUNDOFF["bf16"] * size.layers
    return (step + 1) * per_forward


def shape_keywords(method: str, ranks: int) -> dict[str, int]:
    """The sizes ``method`` needs at P = ``ranks``: its own stages per rank, and the first
    micro-batch count of P and 2P its rules accept (its error where neither is)."""
    from pipeoptim.errors import PlanError
    from pipeoptim.plan.methods.registry import METHODS

    spec = METHODS[method]
    v = spec.default_virtual_stages if spec.places_several_stages_per_rank else None
    refusal: PlanError | None = None
    for m in (ranks, 2 * ranks):
        try:
            spec.shape(ranks, m if spec.micro_batched_by_default else None, None, v)
        except PlanError as e:
            refusal = e
            continue
        keywords = {"stages": ranks}
        if spec.micro_batched_by_default:
            keywords["micro_batches"] = m
        if v is not None:
            keywords["virtual_stages"] = v
        return keywords
    assert refusal is not None
    raise refusal


def pipeline(
    method: str, size: Size, device: str, dtype: torch.dtype = torch.float32, **options: Any
) -> Any:
    """``method`` on the model, every stage in this process on ``device`` (local transport),
    SGD with momentum 0.9."""
    import torch.nn.functional as F

    from pipeoptim import Pipeline
    from pipeoptim.plan.plan import OptimizerSpec

    keywords = {**shape_keywords(method, size.ranks), **options}
    return Pipeline(
        units(size, dtype),
        method=method,
        optimizer=OptimizerSpec("sgd", LR),
        loss_fn=F.cross_entropy,
        device=device,
        transport="local",
        **keywords,
    )


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def losses(method: str, size: Size, device: str, dtype: torch.dtype, **options: Any) -> list[float]:
    """The first ``size.steps`` losses of ``method`` on ``device``."""
    pipe = pipeline(method, size, device, dtype, **options)
    try:
        return list(pipe.fit(batches(size, size.steps, dtype), max_steps=size.steps).losses)
    finally:
        pipe.close()


def worst_ratio(a: list[float], b: list[float], size: Size, scale: float, amp: str | None) -> float:
    """The largest |a - b| / |b| over the steps, each over its step's tolerance times
    ``scale``: at most 1 where every step is within it."""
    if len(a) != len(b):
        raise ValueError(f"runs of different lengths: {len(a)} and {len(b)} losses")
    return max(
        abs(x - y) / abs(y) / (scale * loss_tolerance(size, t, amp))
        for t, (x, y) in enumerate(zip(a, b, strict=True))
    )


def relative_differences(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


@dataclass
class Timed:
    """A throughput run: samples per second over the timed mini-batches, and the run's
    losses."""

    samples_per_s: float
    losses: list[float]
    trace: Any = None
    bounds: list[tuple[int, int]] | None = None
    """The units of each stage (our runs), for PyTorch's runs to split the model alike."""


def time_ours(method: str, size: Size, device: str, **options: Any) -> Timed:
    """``warmup`` mini-batches, then ``timed`` more timed as one fit (the device synchronised
    at both ends); the trace of the timed fit kept for calibration."""
    pipe = pipeline(method, size, device, memory_every=1, **options)
    data = batches(size, size.warmup + size.timed)
    try:
        pipe.fit(data, max_steps=size.warmup)
        synchronize(device)
        start = time.perf_counter()
        result = pipe.fit(data, max_steps=size.warmup + size.timed)
        synchronize(device)
        seconds = time.perf_counter() - start
        rate = size.timed * size.batch / seconds
        return Timed(rate, list(result.losses), pipe.trace(), list(pipe.parts.bounds))
    finally:
        pipe.close()


def time_torch(
    schedule: str, bounds: list[tuple[int, int]], micro_batches: int, size: Size, device: str
) -> Timed:
    """PyTorch's ``schedule`` with every stage on this process's one rank (a group of one):
    the same units split as our runs split them, SGD with momentum 0.9 stepped after each
    ``step``; ``warmup`` untimed steps, then ``timed`` timed."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    model = units(size)
    stage_count = len(bounds)
    target = torch.device(device)
    modules = [nn.Sequential(*model[a:b]).to(target) for a, b in bounds]
    stages = [pipelining.PipelineStage(m, k, stage_count, target) for k, m in enumerate(modules)]
    cls: Callable[..., Any] = getattr(pipelining, schedule)
    runner = cls(stages, micro_batches, loss_fn=F.cross_entropy)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in modules]
    data = [(x.to(target), y.to(target)) for x, y in batches(size, size.warmup + size.timed)]
    seen: list[float] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        parts: list[torch.Tensor] = []
        runner.step(x, target=y, losses=parts)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        seen.append(float(torch.stack(parts).detach().mean()))

    assert dist.is_initialized(), "time_torch needs a process group (gpu_check starts one)"
    for x, y in data[: size.warmup]:
        step(x, y)
    synchronize(device)
    start = time.perf_counter()
    for x, y in data[size.warmup :]:
        step(x, y)
    synchronize(device)
    seconds = time.perf_counter() - start
    return Timed(size.timed * size.batch / seconds, seen)
