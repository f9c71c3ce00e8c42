"""pipeoptim's runtime against PyTorch's own pipelining, measured side by side.

Run from the repository root::

    .venv/bin/python benchmarks/bench_runtime.py              # 2 gloo processes, 3 rounds
    .venv/bin/python benchmarks/bench_runtime.py --ranks 4    # where the machine has 4 cores
    .venv/bin/python benchmarks/bench_runtime.py --quick      # a short smoke run

Workload: an MLP of 8 x (Linear(1024, 1024) + ReLU) and a Linear(1024, 10) head, split
evenly over the ranks (the head on the last), the same split for every run: pipeoptim's
Pipeline gets one unit per rank. Batch 256, M = 4 micro-batches for the
micro-batching methods, SGD with momentum 0.9, cross-entropy on random data. Each rank runs
with cores / ranks threads.

Runs, interleaved round by round so machine noise hits all alike:

* ``torch ScheduleGPipe`` and ``torch Schedule1F1B``: ``torch.distributed.pipelining``
  stages over gloo, one process per stage;
* ``torch ScheduleDualPipeV`` (only when named in ``--runs``): PyTorch's DualPipeV, the
  model split into 2P stages, two per rank in a V; against ``pipeoptim dualpipev`` (the
  same 2P-way split as Pipeline units) its ratio is printed after the table, as are
  gpipe's and 1f1b's against PyTorch's. ``pipeoptim dualpipev`` runs an overlapped step's
  forward and backward back to back, as PyTorch's runtime does;
* ``pipeoptim gpipe``, ``1f1b``, ``zb-h1``, ``pipedream``, ``pipeoptim``:
  ``Pipeline(transport="dist")`` over gloo, one process per stage (zb-h1: the zero-bubble
  schedule, each backward split into an input and a weight pass);
* ``pipeoptim pipeoptim +loggers``: the same with the TensorBoard and JSON-lines loggers
  attached (every pipeoptim run reads its losses every ``LOG_EVERY`` mini-batches, the
  loggers' log points);
* ``limit``: each rank's share of the model trained alone, every rank at the same time in
  its own process with the same threads, no communication (a stage's input and its output's
  gradient are fixed tensors; every rank but the first computes its input's gradient, as the
  whole model's backward does at that cut): what P stages could do with no pipeline cost at
  all, on a machine whose cores are all busy. The throughput is the slowest rank's;
* ``limit +prediction`` and ``limit +stash``: the limit with the weight work PipeOptim
  (Ŵ written after every update) or PipeDream (the weights copied before it) adds on every
  rank but the last: the method's own floor, what its pipeline would do with nothing lost
  to messages, waits or the executor;
* ``locked +stash``: ``limit +stash``'s loops made to wait on one another as asynchronous
  1F1B's stages do (one-element gloo messages in the place of the activations and
  gradients, each forward's weights kept until its backward): the floor with the
  pipeline's dependencies and nothing else of a runtime. On cores the ranks share, a
  stage's passes run against whatever the other stages run at that phase of the pipeline,
  not against a loop drifting freely beside it, and this run measures what that costs
  apart from the runtime.

Rounds take the runs in the order given, then in reverse, in turn, so that a machine
speeding up or slowing down through a round favours no run across two rounds. Each ratio is
printed twice: the ratio of the runs' medians over the rounds, and in brackets the median
of the rounds' own ratios, which pairs each run with the other in the same round (minutes
apart, where the machine's speed may move by a fifth from one round to the next).

Each run trains ``--warmup`` mini-batches, then times ``--steps`` more. A pipeoptim run
times them as one fit, which has a fill at its start and a drain at its end (an asynchronous
pipeline is flushed there only: up to P - 1 mini-batches each way) and the fit's own set-up;
the limit's loop and torch's (flushed every step) have none of these, so each pipeoptim
run is also timed in its steady window, from each rank's trace: the end of its update P to
the end of its update n - 1 - P (:func:`steady_window`), what the run does in the middle of
a long fit. The table gives the median steady samples/s over the rounds, its ratio to
PyTorch's Schedule1F1B and the whole fit's samples/s; then the asynchronous methods' share
of the limit (steady, and the whole fit's), each one's floor against the limit and the
method against its floor (what the runtime itself loses), and where each pipeoptim run's
time goes on each rank, from its own trace of the timed steps: compute (F, B, U and their
halves), the communication actions (sends, and receives including their waits) and the
interpreter between actions (the wall time no action covers). Last, each run's CPU work
over its timed steps (every rank's process, and of it the threads other than the rank's
own: the backend's socket I/O, and torch's intra-op threads where a rank has several), and
the share of the limit that work allows at best on this machine's cores
(:func:`cpu_floor`): a run doing more CPU work than the limit, on cores the limit already
fills, cannot reach it whatever its schedule.

Every run's processes use the same host allocator: by default the thresholds a pipeoptim
Pipeline sets in a CPU process (``pipeoptim/runtime/host_allocator.py``), set in torch's
runs and the limit's too, so that the ratios compare the pipelines and not the allocators;
``--allocator default`` leaves glibc's defaults everywhere (``tune_allocator=False``), and
a run named with the suffix `` (glibc defaults)`` (``"pipeoptim pipeoptim (glibc
defaults)"``) leaves them in that run alone, interleaved with the others.

pipeoptim's ranks on one host send their messages through shared memory
(``runtime/comm/shared_memory.py``); a pipeoptim run named with the suffix `` (gloo)``
(``"pipeoptim pipeoptim (gloo)"``) sends them all over gloo, as torch's runs do, and the
table after the limit's shares gives each run against its ``(gloo)`` twin. Where several
backwards add up before an update (M > 1), a stage adds its linear layers' weight gradients
inside their products (``runtime/stage/accumulate_in_product.py``); the suffix
`` (autograd sums)`` leaves them to autograd's own accumulation, as torch's runs do. A
stage that sends its input's gradient upstream (the asynchronous methods' last stage too)
adds them after that send, at its next action; the suffix `` (weights in the backward)``
adds them in the backward, before the send, as torch's runs do. Each twin is printed
against its base run, round by round.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WIDTH = 1024
BLOCKS = 8
CLASSES = 10


def blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return [*layers, nn.Linear(WIDTH, CLASSES)]


def split(layers: list[nn.Module], ranks: int) -> list[nn.Sequential]:
    """Blocks split evenly; the head joins the last rank."""
    per = 2 * BLOCKS // ranks
    parts = [layers[r * per : (r + 1) * per] for r in range(ranks)]
    parts[-1] = [*parts[-1], *layers[2 * BLOCKS :]]
    return [nn.Sequential(*p) for p in parts]


def pipeline_units(ranks: int) -> list[nn.Module]:
    """What pipeoptim's Pipeline gets: one unit per rank, the split torch's stages and the
    limit train (given the 17 layers, its even split by count would be 9|8, five blocks on
    rank 0 against four)."""
    return list(split(blocks(), ranks))


def data(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    return [(x, y)] * steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, ranks: int, port: int, args: dict[str, Any]) -> None:
    torch.set_num_threads(args["threads"])
    if args.get("over_gloo"):  # read when the Pipeline builds its transport
        os.environ["PIPEOPTIM_SHARED_MEMORY"] = "0"
    if args["allocator"] == "pipeoptim":  # every run's processes alike, the limit's too
        from pipeoptim.runtime.host_allocator import keep_freed_memory

        keep_freed_memory()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)


def _timed(
    step: Callable[[], None], args: dict[str, Any], *, until_all: bool
) -> tuple[float, dict[str, float]]:
    """Seconds of ``args["steps"]`` steps after ``args["warmup"]``, every rank starting
    together; ``until_all``: until the last rank is done, else this rank's own. With them,
    the CPU this process used meanwhile (:func:`_cpu_since`)."""
    for _ in range(args["warmup"]):
        step()
    dist.barrier()
    start, cpu = time.perf_counter(), _cpu_now()
    for _ in range(args["steps"]):
        step()
    used = _cpu_since(cpu)
    if until_all:
        dist.barrier()
    seconds = time.perf_counter() - start
    if not until_all:
        dist.barrier()
    return seconds, used


def _cpu_now() -> tuple[float, float]:
    return time.process_time(), time.thread_time()


def _cpu_since(then: tuple[float, float]) -> dict[str, float]:
    """CPU seconds since ``then`` (:func:`_cpu_now`): the whole process's, and of it the
    threads other than this one: the backend's I/O (gloo reads and writes its sockets there)
    and, where a rank has more than one thread, torch's intra-op threads."""
    process, thread = (now - before for now, before in zip(_cpu_now(), then, strict=True))
    return {"cpu": process, "other threads": max(0.0, process - thread)}


def _torch_rank(rank: int, ranks: int, port: int, args: dict[str, Any], out: Any) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    _init(rank, ranks, port, args)
    x, y = data(args["batch"], 1)[0]
    if args["run"] == DUALPIPE_V:
        schedule, params = _torch_dualpipe_v(rank, ranks, args)
        first, last = rank == 0, rank == 0  # the V: stages 0 and 2P-1 on rank 0
    else:
        module = split(blocks(), ranks)[rank]
        stage = PipelineStage(module, rank, ranks, torch.device("cpu"))
        params = list(module.parameters())
        cls = ScheduleGPipe if args["run"] == "torch ScheduleGPipe" else Schedule1F1B
        schedule = cls(stage, args["micro_batches"], loss_fn=nn.functional.cross_entropy)
        first, last = rank == 0, rank == ranks - 1
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def step() -> None:
        if first and last:
            schedule.step(x, target=y)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds, cpu = _timed(step, args, until_all=True)
    out.put((rank, args["steps"] * args["batch"] / seconds, cpu))
    dist.destroy_process_group()


DUALPIPE_V = "torch ScheduleDualPipeV"
V_METHODS = ("dualpipev", "zb-v")
"""pipeoptim's methods with two stages per rank in a V: their runs split the model into 2P
units, as the torch DualPipeV run splits it into 2P stages."""


def _torch_dualpipe_v(rank: int, ranks: int, args: dict[str, Any]) -> tuple[Any, list[Any]]:
    """PyTorch's DualPipeV on this rank: the model split into 2P stages, stages r and
    2P-1-r here (the V)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    parts = split(blocks(), 2 * ranks)
    mine = (rank, 2 * ranks - 1 - rank)
    stages = [
        PipelineStage(parts[k], k, 2 * ranks, torch.device("cpu"), group=dist.group.WORLD)
        for k in mine
    ]
    schedule = ScheduleDualPipeV(stages, args["micro_batches"], loss_fn=nn.functional.cross_entropy)
    return schedule, [p for k in mine for p in parts[k].parameters()]


LOG_EVERY = 10
"""Mini-batches between the loss reads of every pipeoptim run (the loggers' log points)."""


def _pipeoptim_rank(rank: int, ranks: int, port: int, args: dict[str, Any], out: Any) -> None:
    from pipeoptim import JsonlLogger, Pipeline, TensorBoardLogger
    from pipeoptim.plan.plan import OptimizerSpec

    _init(rank, ranks, port, args)
    method = args["run"].split()[1]
    micro_batching = ("gpipe", "1f1b", "zb-h1", *V_METHODS)
    micro = args["micro_batches"] if method in micro_batching else None
    units = pipeline_units(2 * ranks if method in V_METHODS else ranks)
    loggers: list[Any] = []
    if args["run"].endswith("+loggers"):  # each rank writes its own files (rank{r})
        folder = Path(tempfile.mkdtemp(prefix="bench-runtime-logs-"))
        loggers = [TensorBoardLogger(folder / "tb"), JsonlLogger(folder / "run.jsonl")]
    pipe = Pipeline(
        units,
        method,
        stages=ranks,
        micro_batches=micro,
        optimizer=OptimizerSpec("sgd", 0.01),
        transport="dist",
        device="cpu",
        targets="read",
        log_every=LOG_EVERY,
        loggers=loggers,
        tune_allocator=args["allocator"] == "pipeoptim",
    )
    for stage in pipe.stages.values():
        if args.get("autograd_sums"):
            stage._in_product = None
        elif args.get("weights_in_backward") and stage._in_product is not None:
            stage._in_product.defer = False
    pipe.fit(data(args["batch"], args["warmup"]), max_steps=args["warmup"])
    dist.barrier()
    start, cpu = time.perf_counter(), _cpu_now()
    total = args["warmup"] + args["steps"]
    pipe.fit(data(args["batch"], total), max_steps=total)
    used = _cpu_since(cpu)
    dist.barrier()
    wall = time.perf_counter() - start
    parts = {**_breakdown(pipe, rank, wall, ranks), **used}
    out.put((rank, args["steps"] * args["batch"] / wall, parts))
    pipe.close()


COMPUTE = ("F", "B", "U", "I", "W")


def _breakdown(pipe: Any, rank: int, wall: float, ranks: int) -> dict[str, float]:
    """Seconds of the timed fit on this rank: compute, sends, receives (waits included), and
    the rest of its wall time (the interpreter between actions, the fit's own work); and
    the rank's steady window (:func:`steady_window`)."""
    events = [e for e in pipe.rank_result().events if e.rank == rank]
    end = max(e.end for e in events)
    timed = [e for e in events if e.start >= end - wall]
    out = {"compute": 0.0, "send": 0.0, "receive": 0.0}
    for e in timed:
        key = "compute" if e.kind in COMPUTE else "send" if e.kind.startswith("SEND") else "receive"
        out[key] += e.end - e.start
    out["between actions"] = max(0.0, wall - sum(out.values()))
    out["actions"] = float(len(timed))
    updates, seconds = steady_window(mini_batch_ends(timed), ranks)
    out["steady updates"], out["steady seconds"] = float(updates), seconds
    return out


def mini_batch_ends(events: list[Any]) -> list[float]:
    """The end of each mini-batch's last update on a rank, in order: a rank holding two
    stages (zb-v, dualpipev, interleaved) updates twice per mini-batch, once per stage, and
    the steady window counts mini-batches (a bounded-delay stage's update names the last
    mini-batch it applies)."""
    ends: dict[int, float] = {}
    for e in events:
        if e.kind == "U":
            ends[e.mb] = max(ends.get(e.mb, e.end), e.end)
    return sorted(ends.values())


def steady_window(update_ends: list[float], skip: int) -> tuple[int, float]:
    """The updates a rank made in the middle of a fit and the seconds they took: from the
    end of its update ``skip`` to the end of its update ``n - 1 - skip`` (``update_ends``:
    each update's end, in order). It leaves out the pipeline's fill at the fit's start and
    its drain at the end (up to P - 1 mini-batches each way in an asynchronous pipeline),
    which the limit's loop and torch's (a flush each step) have nothing of: so each run's
    rate is its rate in the middle of a long fit. ``(0, 0.0)``: too few updates."""
    last = len(update_ends) - 1 - skip
    if last <= skip:
        return 0, 0.0
    return last - skip, update_ends[last] - update_ends[skip]


def steady_rate(breakdown: dict[int, dict[str, float]], batch: int) -> float | None:
    """A pipeoptim run's samples/s in its steady window, its slowest rank's
    (:func:`steady_window`); None where a rank has none (a fit too short)."""
    rates = [
        p["steady updates"] * batch / p["steady seconds"]
        for p in breakdown.values()
        if p.get("steady seconds", 0.0) > 0
    ]
    return min(rates) if rates and len(rates) == len(breakdown) else None


FLOORS = {"limit +prediction": "pipeoptim pipeoptim", "limit +stash": "pipeoptim pipedream"}
"""Each method's own floor: the limit plus the weight work the method adds on the same ranks
(every rank but the last, where a forward and its backward have updates between them):
PipeOptim's Ŵ written after each update, with the library's own predictor (distance
P - 1 - rank), or PipeDream's copy of the weights the step is about to change (the stash).
A pipeline at its floor loses nothing to messages, waits or the executor."""


def floor_distance(rank: int, ranks: int) -> int:
    """Updates between a forward and its backward on ``rank`` in the asynchronous 1F1B
    order: PipeOptim's prediction distance there, and where PipeDream stashes (above 0)."""
    return ranks - 1 - rank


class _LimitLoop:
    """One rank's share of the model and its fixed data, as the limit's loops train it
    (``limit``, its floors and ``locked +stash`` alike)."""

    def __init__(self, rank: int, ranks: int, batch: int) -> None:
        self.module = split(blocks(), ranks)[rank]
        self.params = list(self.module.parameters())
        self.opt = torch.optim.SGD(self.params, lr=0.01, momentum=0.9)
        self.x, self.y = data(batch, 1)[0]
        self.grad = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(2))
        """The output's gradient of every rank but the last (fixed, as its input is)."""
        if rank > 0:  # the gradient a stage sends back is work the model's own backward does
            self.x = self.x.clone().requires_grad_()
        self.last = rank == ranks - 1

    def backward(self, output: torch.Tensor) -> None:
        """The backward from ``output``: the loss's on the last rank, else the fixed
        gradient's."""
        if self.last:
            nn.functional.cross_entropy(output, self.y).backward()
        else:
            output.backward(self.grad)

    def update(self) -> None:
        """The step, and every gradient cleared for the next backward."""
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.x.grad = None


def _limit_rank(rank: int, ranks: int, port: int, args: dict[str, Any], out: Any) -> None:
    """One rank's share of the model trained alone, at the same time as the others; under a
    :data:`FLOORS` name, with that method's weight work as well."""
    from pipeoptim.runtime.optim.predict import predictor_for

    _init(rank, ranks, port, args)
    loop = _LimitLoop(rank, ranks, args["batch"])
    module, params, x = loop.module, loop.params, loop.x
    distance = floor_distance(rank, ranks)
    predicting = args["run"] == "limit +prediction" and distance > 0
    stashing = args["run"] == "limit +stash" and distance > 0
    predictor = predictor_for(loop.opt) if predicting else None
    predicted = [torch.empty_like(p) for p in params] if predicting else []

    def step() -> None:
        loop.backward(module(x))
        if stashing:  # the runtime's stash: the parameters move to a copy the step updates
            with torch.no_grad():
                for p in params:
                    p.data = p.data.clone()
        loop.update()
        if predictor is not None:
            predictor.predict_into(predicted, distance)

    seconds, cpu = _timed(step, args, until_all=False)  # this rank's own time
    out.put((rank, args["steps"] * args["batch"] / seconds, cpu))
    dist.destroy_process_group()


LOCKED = "locked +stash"
"""The run of the limit's loops locked into the asynchronous 1F1B order, with PipeDream's
stash (:func:`_locked_rank`): what the pipeline's dependencies cost on these cores."""


def _locked_rank(rank: int, ranks: int, port: int, args: dict[str, Any], out: Any) -> None:
    """The limit's loop on ``rank``, made to wait as an asynchronous 1F1B pipeline's stage
    does: one-element gloo messages stand for the activations and gradients, so each rank
    runs its passes in the phase the pipeline's dependencies set, against the same work on
    the other cores, with nothing else of a runtime. A rank at distance above 0 runs its
    first forwards ahead (:func:`floor_distance`) and keeps each forward's weights until its
    backward: a copy per step, PipeDream's stash, as in ``limit +stash``."""
    _init(rank, ranks, port, args)
    loop = _LimitLoop(rank, ranks, args["batch"])
    module, params, x = loop.module, loop.params, loop.x
    names = [name for name, _ in module.named_parameters()]
    distance = floor_distance(rank, ranks)
    token, sent = torch.zeros(1), []

    def tell(peer: int) -> None:  # one element for the tensor the pipeline would send
        work = dist.isend(token, peer)
        if work is not None:
            sent.append(work)

    in_flight: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def forward() -> None:
        if rank > 0:
            dist.recv(torch.zeros(1), rank - 1)
        if distance > 0:  # the stash: the forward's own copy of the weights, kept
            weights = [p.detach().clone().requires_grad_() for p in params]
            output = torch.func.functional_call(
                module, dict(zip(names, weights, strict=True)), (x,)
            )
        else:
            weights, output = list(params), module(x)
        if rank < ranks - 1:
            tell(rank + 1)
        in_flight.append((output, weights))

    def step() -> None:
        forward()
        output, weights = in_flight.pop(0)
        if rank < ranks - 1:
            dist.recv(torch.zeros(1), rank + 1)
        loop.backward(output)
        if rank > 0:
            tell(rank - 1)
        if distance > 0:
            for p, w in zip(params, weights, strict=True):
                p.grad = w.grad
        loop.update()
        while len(sent) > 2 * ranks:
            sent.pop(0).wait()

    for _ in range(distance):
        forward()
    seconds, cpu = _timed(step, args, until_all=False)
    if rank > 0:  # the forward the rank before ran ahead of its last backward
        dist.recv(torch.zeros(1), rank - 1)
    for work in sent:
        work.wait()
    out.put((rank, args["steps"] * args["batch"] / seconds, cpu))
    dist.barrier()
    dist.destroy_process_group()


def _spawned(
    target: Callable[..., None], ranks: int, args: dict[str, Any]
) -> tuple[float, dict[int, dict[str, float]]]:
    """The run's samples/s (its slowest rank's) and each rank's breakdown."""
    # each rank forks from a server that imported torch once (fresh processes, as spawn's,
    # without a torch import per rank and run: half a smallest run's wall time on 2 cores)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, ranks, port, args, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=600) for _ in range(ranks)]
    for p in procs:
        p.join(timeout=60)
    rate = min(float(r) for _, r, _ in reports)
    return rate, {rank: parts for rank, _, parts in reports}


def cpu_floor(parts: dict[int, dict[str, float]], cores: int) -> float:
    """The shortest wall time, in seconds, that a run's CPU work allows on ``cores`` cores
    (``parts``: each rank's ``cpu`` and ``other threads``, :func:`_cpu_since`): no shorter
    than a rank's own thread, whose work runs in order, nor than all the ranks' CPU spread
    evenly over the cores. A run that takes longer waits or leaves a core idle meanwhile;
    one that does more CPU work than the limit cannot reach it where the cores are full."""
    own = max(p["cpu"] - p["other threads"] for p in parts.values())
    return max(own, sum(p["cpu"] for p in parts.values()) / cores)


OVER_GLOO = " (gloo)"
"""A pipeoptim run name ending so sends every message over gloo
(``PIPEOPTIM_SHARED_MEMORY=0``): ``--runs "pipeoptim pipeoptim,pipeoptim pipeoptim (gloo)"``
measures the shared-memory transport's effect in one run."""

AUTOGRAD_SUMS = " (autograd sums)"
"""A pipeoptim run name ending so leaves the micro-batches' weight gradients to autograd's
own accumulation (a new tensor per product, then an add) rather than adding them inside
the products (``runtime/stage/accumulate_in_product.py``)."""

WEIGHTS_IN_BACKWARD = " (weights in the backward)"
"""A pipeoptim run name ending so adds every weight gradient in its backward, before the
input's gradient goes upstream, rather than at the stage's next action
(``AccumulateInProduct.defer``, on every stage but the first)."""

GLIBC_DEFAULTS = " (glibc defaults)"
"""A run name ending so runs with glibc's allocator defaults whatever ``--allocator`` says:
``--runs "limit,limit (glibc defaults)"`` measures the allocator's effect in one run."""

SWITCHES = {
    OVER_GLOO: "over_gloo",
    AUTOGRAD_SUMS: "autograd_sums",
    WEIGHTS_IN_BACKWARD: "weights_in_backward",
}
"""Each pipeoptim twin's name ending and the switch its job sets (read by the ranks)."""

RUNS = (
    "torch ScheduleGPipe",
    "torch Schedule1F1B",
    "pipeoptim gpipe",
    "pipeoptim 1f1b",
    "pipeoptim zb-h1",
    "pipeoptim pipedream",
    "pipeoptim pipeoptim",
    "pipeoptim pipeoptim +loggers",
    "limit",
    *FLOORS,
    LOCKED,
)


OPTIONAL_RUNS = (DUALPIPE_V,)
"""Runs ``--runs`` takes that the default set leaves out."""
TORCH_TWINS = {
    "pipeoptim gpipe": "torch ScheduleGPipe",
    "pipeoptim 1f1b": "torch Schedule1F1B",
    "pipeoptim dualpipev": DUALPIPE_V,
}
"""Each pipeoptim run and PyTorch's run of the same schedule, printed against each other."""


def base_name(run: str) -> str:
    """``run`` without its twin's name ending (:data:`SWITCHES`, :data:`GLIBC_DEFAULTS`)."""
    for suffix in (GLIBC_DEFAULTS, *SWITCHES):
        run = run.removesuffix(suffix)
    return run


def run_refusal(run: str) -> str | None:
    """Why ``--runs`` cannot take ``run``, with the names it can; None where it can: a run
    of :data:`RUNS` or ``pipeoptim <method>`` (``+loggers`` after it as well), with a twin's
    ending, and the pipeoptim twins' endings only on pipeoptim runs (no other run reads
    their switches)."""
    from pipeoptim.plan.methods import METHODS

    base = base_name(run)
    method = base.removeprefix("pipeoptim ").removesuffix(" +loggers")
    pipeoptim_run = base.startswith("pipeoptim ") and method in METHODS
    known = (*RUNS, *OPTIONAL_RUNS)
    if base not in known and not pipeoptim_run:
        return (
            f"--runs: no run {run!r}; give runs of {', '.join(known)}, or 'pipeoptim <method>' "
            f"with a method of {', '.join(METHODS)}, each with a twin's ending if you like "
            f"({', '.join(repr(s) for s in (*SWITCHES, GLIBC_DEFAULTS))})"
        )
    ending = run.removesuffix(GLIBC_DEFAULTS)[len(base) :]
    if ending and not pipeoptim_run:
        return (
            f"--runs: {run!r}: only a pipeoptim run takes the ending {ending!r}; drop it, or "
            f"name a pipeoptim run (e.g. 'pipeoptim pipeoptim{ending}')"
        )
    return None


def round_order(runs: list[str], round_: int) -> list[str]:
    """The runs in the order round ``round_`` (from 0) takes them: as given, then reversed,
    in turn (A B, B A, A B, ...), so that a machine growing faster or slower through a round
    favours neither of two runs across two rounds."""
    return list(runs) if round_ % 2 == 0 else list(reversed(runs))


def paired(over: list[float], under: list[float]) -> float:
    """The median of the rounds' own ratios ``over / under``: each round's two runs met
    the same machine, minutes apart, where the ratio of the medians pairs runs of different
    rounds."""
    return statistics.median(x / y for x, y in zip(over, under, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="1 round of 8 steps")
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help="comma-separated runs: of the default set, or 'pipeoptim <method>', each with a "
        "twin's ending if you like (a name it does not know stops the script before any run)",
    )
    parser.add_argument(
        "--allocator",
        choices=("pipeoptim", "default"),
        default="pipeoptim",
        help="the host allocator of every run's processes: the thresholds a pipeoptim "
        "Pipeline sets on the CPU (runtime/host_allocator.py), or glibc's defaults",
    )
    a = parser.parse_args()
    if a.quick:
        a.rounds, a.steps, a.warmup = 1, 8, 2
    if 2 * BLOCKS % a.ranks:
        sys.exit(f"--ranks must divide {2 * BLOCKS} (the layers are split evenly)")
    cores = os.cpu_count() or 1
    if a.ranks > cores:
        print(f"note: {a.ranks} ranks on {cores} cores: the ranks share cores", file=sys.stderr)
    args = {
        "batch": a.batch,
        "steps": a.steps,
        "warmup": a.warmup,
        "micro_batches": a.micro_batches,
        "threads": max(1, cores // a.ranks),
        "allocator": a.allocator,
    }
    runs = [r for r in a.runs.split(",") if r]
    refused = [refusal for r in runs if (refusal := run_refusal(r)) is not None]
    if refused:
        parser.error("; ".join(refused))
    rates: dict[str, list[float]] = {r: [] for r in runs}
    steady: dict[str, list[float]] = {r: [] for r in runs}
    """Each run's rate in the middle of its fit (:func:`steady_window`): the pipeoptim
    runs' from their traces; the limit's and torch's loops are that already."""
    parts: dict[str, list[dict[int, dict[str, float]]]] = {r: [] for r in runs}
    for round_ in range(a.rounds):
        for run in round_order(runs, round_):
            base_run = base_name(run)
            job = {
                **args,
                "run": base_run,
                "allocator": "default" if run.endswith(GLIBC_DEFAULTS) else a.allocator,
                **{switch: run.endswith(suffix) for suffix, switch in SWITCHES.items()},
            }
            if base_run == "limit" or base_run in FLOORS:
                target: Callable[..., None] = _limit_rank
            elif base_run == LOCKED:
                target = _locked_rank
            elif base_run.startswith("torch"):
                target = _torch_rank
            else:
                target = _pipeoptim_rank
            rate, breakdown = _spawned(target, a.ranks, job)
            rates[run].append(rate)
            steady[run].append(steady_rate(breakdown, a.batch) or rate)
            parts[run].append(breakdown)
            print(
                f"round {round_ + 1}: {run}: {rate:,.0f} samples/s (steady {steady[run][-1]:,.0f})",
                file=sys.stderr,
            )
    named = any(r.endswith(GLIBC_DEFAULTS) for r in runs)
    except_named = f" not named '...{GLIBC_DEFAULTS}'" if named else ""
    print(
        f"# {platform.processor() or platform.machine()}, {cores} cores, torch "
        f"{torch.__version__}; {a.ranks} gloo ranks, batch {a.batch}, M = {a.micro_batches}, "
        f"{a.steps} timed steps, median of {a.rounds} interleaved rounds; host allocator: "
        f"{a.allocator} in every run{except_named}"
    )
    print(
        "steady: samples/s from the end of each rank's update P to the end of its update "
        "n - 1 - P (the fit's fill and drain left out; the limit's and torch's loops have "
        "none); whole fit: from the fit's start to its last rank's end"
    )
    torch_1f1b = steady.get("torch Schedule1F1B")
    print(
        "ratios: of the medians over the rounds, then [the median of the rounds' own ratios]\n"
        "| run | samples/s, steady | vs torch Schedule1F1B | samples/s, whole fit |"
    )
    print("|---|---|---|---|")
    for run, values in steady.items():
        med = statistics.median(values)
        ratio = "-"
        if torch_1f1b:
            ratio = (
                f"{med / statistics.median(torch_1f1b):.2f}x [{paired(values, torch_1f1b):.2f}x]"
            )
        print(f"| {run} | {med:,.0f} | {ratio} | {statistics.median(rates[run]):,.0f} |")
    _print_torch_twins(steady)
    for suffix in ("", GLIBC_DEFAULTS):  # each run against the limit under its allocator
        if "limit" + suffix not in rates:
            continue
        top = statistics.median(rates["limit" + suffix])
        print(
            f"\nshare of the {a.ranks}-stage limit{suffix} (all cores busy; goal >= 0.95x), "
            f"steady (whole fit):"
        )
        limit = rates["limit" + suffix]
        for name in ("pipeoptim pipedream", "pipeoptim pipeoptim", "pipeoptim 1f1b"):
            if name + suffix in rates:
                run_steady, run_fit = steady[name + suffix], rates[name + suffix]
                print(
                    f"  {name + suffix}: {statistics.median(run_steady) / top:.2f}x "
                    f"({statistics.median(run_fit) / top:.2f}x) "
                    f"[{paired(run_steady, limit):.2f}x ({paired(run_fit, limit):.2f}x)]"
                )
    floors = [(f, m) for f, m in FLOORS.items() if f in rates and m in rates]
    if floors and "limit" in rates:
        top = statistics.median(rates["limit"])
        print("\neach method's own floor (the limit with the method's weight work added):")
        for floor, method in floors:
            bottom = statistics.median(rates[floor])
            against = paired(rates[floor], rates["limit"])
            print(
                f"  {floor}: {bottom / top:.2f}x the limit [{against:.2f}x]; "
                f"{method}: {statistics.median(steady[method]) / bottom:.2f}x its floor, steady "
                f"[{paired(steady[method], rates[floor]):.2f}x]"
            )
    stash, method = "limit +stash", FLOORS["limit +stash"]
    if LOCKED in rates and stash in rates:
        locked = rates[LOCKED]
        print(
            f"\nthe floor locked in the pipeline's order ({LOCKED}: the limit's loops waiting on "
            f"one another as asynchronous 1F1B's stages do, no runtime):\n"
            f"  {LOCKED}: {statistics.median(locked) / statistics.median(rates[stash]):.2f}x "
            f"{stash} [{paired(locked, rates[stash]):.2f}x]"
        )
        if method in rates:
            print(
                f"  {method}: {statistics.median(steady[method]) / statistics.median(locked):.2f}x "
                f"{LOCKED}, steady [{paired(steady[method], locked):.2f}x]"
            )
    for suffix, what in (  # each run against its twin
        (GLIBC_DEFAULTS, f"the host allocator ({a.allocator}) against glibc's defaults"),
        (OVER_GLOO, "shared memory between the ranks against gloo alone"),
        (AUTOGRAD_SUMS, "weight gradients added in their products against autograd's sums"),
        (
            WEIGHTS_IN_BACKWARD,
            "weight gradients added after the input's gradient is sent against in the backward",
        ),
    ):
        twins = [r for r in runs if r + suffix in rates]
        if twins:
            print(f"\n{what}, same rounds (steady):")
            for run in twins:
                gain = paired(steady[run], steady[run + suffix])
                print(f"  {run}: {gain:.2f}x (median of the rounds' ratios)")
    bare, logged = "pipeoptim pipeoptim", "pipeoptim pipeoptim +loggers"
    if bare in rates and logged in rates:
        cost = statistics.median(rates[logged]) / statistics.median(rates[bare])
        print(f"\nwith the loggers attached: {cost:.2f}x the samples/s without them")
    print("\nwhere the time goes, per rank, median over rounds (seconds of the timed steps):")
    print("| run | rank | compute | send | receive (waits included) | between actions | actions |")
    print("|---|---|---|---|---|---|---|")
    for run, rounds in parts.items():
        if not run.startswith("pipeoptim"):
            continue
        for rank in sorted(rounds[0]):
            cells = [
                statistics.median(r[rank][key] for r in rounds)
                for key in ("compute", "send", "receive", "between actions", "actions")
            ]
            print(
                f"| {run} | {rank} | {cells[0]:.3f} | {cells[1]:.3f} | {cells[2]:.3f} | "
                f"{cells[3]:.3f} | {cells[4]:.0f} |"
            )
    if "limit" in rates:
        _print_cpu(rates, parts, a.steps * a.batch, cores)


def _print_torch_twins(steady: dict[str, list[float]]) -> None:
    """Each pipeoptim run against PyTorch's run of the same schedule, where both ran
    (:data:`TORCH_TWINS`; steady samples/s, goal >= 1.0x)."""
    twins = [
        (ours, theirs)
        for ours, theirs in TORCH_TWINS.items()
        if ours in steady and theirs in steady
    ]
    if not twins:
        return
    print("\nagainst PyTorch's own schedule, steady (goal >= 1.0x):")
    for ours, theirs in twins:
        ratio = statistics.median(steady[ours]) / statistics.median(steady[theirs])
        print(f"  {ours} / {theirs}: {ratio:.2f}x [{paired(steady[ours], steady[theirs]):.2f}x]")


def _print_cpu(
    rates: dict[str, list[float]],
    parts: dict[str, list[dict[int, dict[str, float]]]],
    samples: int,
    cores: int,
) -> None:
    """Each run's CPU work against the limit's: how much of the limit that work allows on
    this machine's cores (:func:`cpu_floor`), and how much the run reached."""
    top = statistics.median(rates["limit"])
    print(
        f"\nCPU work over the timed steps, seconds, median over rounds; at best a run takes "
        f"the longer of a rank's own thread and all its CPU spread over the {cores} cores:"
    )
    print("| run | CPU, all ranks | busiest rank | other threads | share it allows | reached |")
    print("|---|---|---|---|---|---|")
    for run, rounds in parts.items():
        total = statistics.median(sum(p["cpu"] for p in r.values()) for r in rounds)
        busiest = statistics.median(max(p["cpu"] for p in r.values()) for r in rounds)
        other = statistics.median(sum(p["other threads"] for p in r.values()) for r in rounds)
        allows = statistics.median(samples / cpu_floor(r, cores) for r in rounds) / top
        reached = statistics.median(rates[run]) / top
        print(
            f"| {run} | {total:.3f} | {busiest:.3f} | {other:.3f} | {allows:.2f}x | "
            f"{reached:.2f}x |"
        )


if __name__ == "__main__":
    main()
