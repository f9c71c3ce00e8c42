"""Profiling a built-in (or ``module:factory``) model on a batch of its own training data.

``pipeoptim profile --model NAME`` and the convergence study's hardware profile measure a
model by name; building it by name is this package's, measuring any layers is the runtime
profiler's (:func:`~pipeoptim.runtime.profiling.profiler.profile_model`), so the entry point
that joins the two lives here and the runtime never imports the workloads. On CPU it takes
the profile under the conditions of a pipeline run on this machine: the threads a rank gets
and busy stand-ins for the other ranks. For a run of several ranks it also measures, under
the same conditions, what the runtime costs there beyond the layers
(:class:`~pipeoptim.plan.runtime_costs.RuntimeCosts`): a message between two processes over
gloo (:func:`~pipeoptim.runtime.profiling.messages.time_messages`: its latency and how much
slower work runs between waits), the runtime's own work per message at each end, from a
short run of the model's stages on two processes
(:func:`~pipeoptim.workloads.message_probe.probe_messages`), and the executor's and the
stage's own work per action, from a short run of the model's own stages in this process
(:func:`action_costs`); both need the Pipeline, so they live here too. Where the ranks
outnumber the cores, the model run as they will run it replaces the loop times and the
slowdowns (:mod:`~pipeoptim.workloads.layout_probe`)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from pipeoptim.errors import PipeoptimError, RuntimeConfigError
from pipeoptim.plan.machine import Machine, this_machine_cores
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.runtime_costs import ACTION_KINDS, RuntimeCosts
from pipeoptim.runtime.comm.placement import rank_threads
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.profiling.layer_memory import trainable_bytes
from pipeoptim.runtime.profiling.messages import MessageTiming, time_messages
from pipeoptim.runtime.profiling.profiler import profile_model
from pipeoptim.workloads.layout_probe import adopt_layout, probe_layout
from pipeoptim.workloads.loader import build_model, model_loss
from pipeoptim.workloads.message_probe import PROBE_METHOD, RuntimeMessages, probe_messages

__all__ = [
    "LAYOUT_STEPS",
    "POLICY_METHODS",
    "PROBE_BUDGET_S",
    "PROBE_STEPS",
    "action_costs",
    "budget_steps",
    "profile_builtin",
]

PROBE_STEPS = (24, 120)
"""Mini-batches the message probe trains: as many as about ``PROBE_BUDGET_S`` of the
model's compute by its profile (:func:`budget_steps`), within these bounds (its fit reads
the middle half, and a mean over a few dozen messages still moves with one late wake-up)."""

PROBE_BUDGET_S = 1.0

LAYOUT_STEPS = (48, 240)
"""Mini-batches the layout probe (:mod:`pipeoptim.workloads.layout_probe`) trains, by the
same budget (the digits MLP's 240 take about 2 s on 4 ranks of a 2-core machine)."""

POLICY_METHODS: dict[str, tuple[str, ...]] = {
    "flush": ("1f1b", "zb-h1"),
    "stash": ("pipedream",),
    "double-buffer": ("2bw",),
    "predict": ("pipeoptim",),
}
"""The methods whose short runs measure each weight policy's fixed cost per action: what a
stage does around its passes is its policy's (a stash, two buffers, a prediction), the
same for every method of the policy; ``zb-h1`` gives the synchronous split backward's I
and W."""


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
    runtime: Callable[[Profile], RuntimeCosts] | None = None
    problem: str | None = None
    message: MessageTiming | None = None
    probed: RuntimeMessages | None = None
    probe_problem: str | None = None
    if on_cpu and ranks is not None and ranks > 1:
        try:  # before the busy stand-ins start: the two processes each get a core
            message = time_messages()
        except (RuntimeError, OSError) as err:
            message, problem = None, f"{type(err).__name__}: {err}"

        def runtime(layer_profile: Profile) -> RuntimeCosts:
            n = min(len(data.train_x) // batch_size, 24) * batch_size
            batches = [
                (data.train_x[i : i + batch_size], data.train_y[i : i + batch_size])
                for i in range(0, n, batch_size)
            ]
            actions = action_costs(layers, batches, layer_profile, model, ranks, optimizer, seed)
            if message is None:
                return RuntimeCosts(action_s=actions)
            return RuntimeCosts(
                message_send_s=message.send_s,
                message_receive_s=message.receive_s,
                message_latency_s=message.latency_s,
                burst_slowdown=message.burst_slowdown,
                shared_burst_slowdown=message.shared_burst_slowdown,
                action_s=actions,
                burst_s=message.burst_s,
                shared_burst_s=message.shared_burst_s,
            )

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
        runtime=runtime,
    )
    threads_used = profile.meta.get("threads") or 1
    if on_cpu:
        machine = Machine(this_machine_cores(), ranks or 1, threads_used)
    else:  # a rank per accelerator (ranks beyond them share one), one host thread each
        machine = Machine(max(1, torch.cuda.device_count()), ranks or 1, 1)
    runtime_costs = profile.runtime_costs
    laid_out = False
    layout_problem: str | None = None
    # where the ranks take turns on the cores (and the model has a layer per rank), time
    # the model as they will run it
    turns = on_cpu and ranks is not None and machine.shares_cores and ranks <= len(layers)
    shared = ranks if turns else None
    if message is not None and runtime_costs is not None and shared is not None:
        if progress:
            print(
                f"timing the model as its {shared} ranks share this machine's cores: "
                f"{shared} processes over gloo",
                file=sys.stderr,
            )
        try:
            trace = probe_layout(
                model,
                stages=shared,
                batch_size=batch_size,
                steps=budget_steps(profile, PROBE_BUDGET_S, *LAYOUT_STEPS),
                optimizer=optimizer,
                seed=seed,
            )
            profile = adopt_layout(profile, trace)
            laid_out = True
        except (RuntimeError, OSError, ValueError, PipeoptimError) as err:
            layout_problem = f"{type(err).__name__}: {err}"
    if message is not None and runtime_costs is not None and not laid_out:
        # after the busy stand-ins stopped: the probe's two processes each get a core
        if progress:
            print(
                "timing the runtime's messages: the model on 2 processes over gloo",
                file=sys.stderr,
            )
        try:
            probed = probe_messages(
                model,
                batch_size=batch_size,
                steps=budget_steps(profile, PROBE_BUDGET_S, *PROBE_STEPS),
                optimizer=optimizer,
                seed=seed,
            )
        except (RuntimeError, OSError, ValueError) as err:
            probe_problem = f"{type(err).__name__}: {err}"
        else:  # the runtime's work per message replaces gloo's alone
            runtime_costs = dataclasses.replace(
                runtime_costs, message_send_s=probed.send_s, message_receive_s=probed.receive_s
            )
            profile = dataclasses.replace(profile, runtime_costs=runtime_costs)
    meta = {**profile.meta, "model": model, "ranks": ranks, "machine": machine.to_dict()}
    if problem is not None:
        meta["messages_failed"] = problem
    if probed is not None:
        meta["message_probe"] = {
            "method": PROBE_METHOD,
            "stages": 2,
            "mini_batches": probed.mini_batches,
            "send_s": probed.send_s,
            "receive_s": probed.receive_s,
        }
    elif probe_problem is not None:
        meta["message_probe_failed"] = probe_problem
    if layout_problem is not None:
        meta["layout_probe_failed"] = layout_problem
    return dataclasses.replace(profile, meta=meta)


def action_costs(
    layers: Sequence[nn.Module],
    batches: Sequence[tuple[Tensor, Tensor]],
    profile: Profile,
    model: str,
    stages: int,
    optimizer: str = "sgd",
    seed: int = 0,
    *,
    budget_s: float = 0.5,
    runs: int = 2,
) -> dict[str, dict[str, float]]:
    """Per weight policy (:data:`POLICY_METHODS`) the fixed seconds of one action of each
    kind beyond its layers: a copy of ``layers`` trained for a few ``batches`` by the real
    Pipeline in this process (one process, so no message is timed), split evenly into
    ``stages`` stages; each action's traced time less its layers' time at its micro-batch
    by ``profile`` (and a predicted forward's prediction), the median per stage over the
    last two thirds of the run (after the first steps' allocations), the mean over the
    stages (the last one's loss included), never below 0; the mean of ``runs`` such runs.
    Each run takes about ``budget_s`` of the model's own compute (6 to 24 mini-batches)."""
    steps = min(budget_steps(profile, budget_s, 6, 24), len(batches))
    found: dict[str, dict[str, float]] = {}
    for policy, methods in POLICY_METHODS.items():
        kinds: dict[str, float] = {}
        for method in methods:
            measured: dict[str, list[float]] = defaultdict(list)
            for _ in range(max(1, runs)):
                for kind, value in _method_costs(
                    layers, batches[:steps], profile, model, stages, method, optimizer, seed
                ).items():
                    measured[kind].append(value)
            for kind, values in measured.items():
                kinds.setdefault(kind, statistics.fmean(values))
        found[policy] = {k: kinds[k] for k in ACTION_KINDS if k in kinds}
    return found


def _method_costs(
    layers: Sequence[nn.Module],
    batches: Sequence[tuple[Tensor, Tensor]],
    profile: Profile,
    model: str,
    stages: int,
    method: str,
    optimizer: str,
    seed: int,
) -> dict[str, float]:
    """:func:`action_costs` of one method's run: kind -> seconds."""
    pipe = Pipeline(
        [copy.deepcopy(m) for m in layers],
        method,
        stages=stages,
        optimizer=OptimizerSpec(optimizer, 1e-4),
        loss_fn=model_loss(model),
        device=profile.device,
        seed=seed,
        log_every=len(batches) + 1,
    )
    trace = pipe.fit(list(batches), max_steps=len(batches)).trace
    m = int(trace.meta.get("micro_batches") or 1)
    samples = profile.batch_size / m
    bounds = [tuple(b) for b in trace.meta["boundaries"]]
    skip = len(batches) // 3
    spent: dict[tuple[str, int], list[float]] = defaultdict(list)
    # a predicting stage's updates compute the kept Δ (``Stage._prepare_deltas``)
    predicting = {e.stage for e in trace.events if e.kind == "F" and e.distance > 0}
    setup = {
        k: math.fsum(x.prediction_setup_s or 0.0 for x in profile.layers[a:b])
        if k in predicting
        else 0.0
        for k, (a, b) in enumerate(bounds)
    }
    for e in trace.events:
        if e.kind not in ACTION_KINDS or (e.mb if e.kind == "U" else e.mb // m) < skip:
            continue
        start, end = bounds[e.stage]
        own = profile.layers[start:end]
        times = [x.time_at(samples, profile.batch_size) for x in own]
        forward = math.fsum(f for f, _ in times)
        backward = math.fsum(b for _, b in times)
        weight = math.fsum(x.weight_grad_fraction * b for x, (_, b) in zip(own, times, strict=True))
        layer_s = {
            "F": forward + (math.fsum(x.predict_s for x in own) if e.distance > 0 else 0.0),
            "B": backward,
            "U": math.fsum(x.update_s for x in own) + setup[e.stage],
            "I": backward - weight,
            "W": weight,
        }[e.kind]
        spent[(e.kind, e.stage)].append(e.duration - layer_s)
    per_kind: dict[str, list[float]] = defaultdict(list)
    for (kind, _), values in spent.items():
        per_kind[kind].append(statistics.median(values))
    return {k: max(0.0, statistics.fmean(v)) for k, v in per_kind.items()}


def budget_steps(profile: Profile, budget_s: float, low: int, high: int) -> int:
    """Mini-batches that take about ``budget_s`` of the model's compute by ``profile``
    (its passes and updates at the profiled batch), within ``low`` and ``high``."""
    per_batch = profile.total_compute_s + sum(x.update_s for x in profile.layers)
    return int(min(high, max(low, budget_s / per_batch if per_batch > 0 else high)))


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
