"""Profiling a built-in (or ``module:factory``) model on a batch of its own training data.

``pipeoptim profile --model NAME`` and the convergence study's hardware profile measure a
model by name; building it by name is this package's, measuring any layers is the runtime
profiler's (:func:`~pipeoptim.runtime.profiling.profiler.profile_model`), so the entry point
that joins the two lives here and the runtime never imports the workloads. On CPU it takes
the profile under the conditions of a pipeline run on this machine: the threads a rank gets
and busy stand-ins for the other ranks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
from torch import nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.machine import Machine, this_machine_cores
from pipeoptim.plan.profile import Profile
from pipeoptim.runtime.comm.placement import rank_threads
from pipeoptim.runtime.profiling.layer_memory import trainable_bytes
from pipeoptim.runtime.profiling.profiler import profile_model
from pipeoptim.workloads.loader import build_model

__all__ = ["profile_builtin"]


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
    ``meta["machine"]`` records the host the ranks will share (its cores, the ranks, each
    one's threads: :class:`~pipeoptim.plan.machine.Machine`).
    """
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
    machine = Machine(this_machine_cores(), ranks or 1, profile.meta.get("threads") or 1)
    meta = {**profile.meta, "model": model, "ranks": ranks, "machine": machine.to_dict()}
    return dataclasses.replace(profile, meta=meta)


def _stage_bytes(layers: Sequence[nn.Module], ranks: int | None) -> int | None:
    """About one stage's trainable bytes when the model is split over ``ranks``."""
    total = sum(trainable_bytes(m) for m in layers)
    return max(1, total // ranks) if ranks and total else None


def _neighbours(ranks: int | None) -> int:
    """Busy processes standing in for the other ranks: those that can run alongside this
    one at once (more than the cores only take turns)."""
    if not ranks:
        return 0
    return max(0, min(ranks, os.cpu_count() or 1) - 1)
