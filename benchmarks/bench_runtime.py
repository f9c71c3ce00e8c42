"""pipeoptim's runtime against PyTorch's own pipelining, measured side by side.

Run from the repository root::

    .venv/bin/python benchmarks/bench_runtime.py              # 2 gloo processes, 3 rounds
    .venv/bin/python benchmarks/bench_runtime.py --ranks 4    # where the machine has 4 cores
    .venv/bin/python benchmarks/bench_runtime.py --quick      # a short smoke run

Workload: an MLP of 8 x (Linear(1024, 1024) + ReLU) and a Linear(1024, 10) head, split
evenly over the ranks (the head on the last). Batch 256, M = 4 micro-batches for the
micro-batching methods, SGD with momentum 0.9, cross-entropy on random data. Each rank runs
with cores / ranks threads.

Runs, interleaved round by round so machine noise hits all alike:

* ``torch ScheduleGPipe`` and ``torch Schedule1F1B``: ``torch.distributed.pipelining``
  stages over gloo, one process per stage;
* ``pipeoptim gpipe``, ``1f1b``, ``zb-h1``, ``pipedream``, ``pipeoptim``:
  ``Pipeline(transport="dist")`` over gloo, one process per stage (zb-h1: the zero-bubble
  schedule, each backward split into an input and a weight pass);
* ``limit``: the whole model in one process with one thread, times the number of ranks:
  what P stages could do with no pipeline cost at all.

Each run trains ``--warmup`` mini-batches, then times ``--steps`` more. The table gives
the median samples/s over the rounds and the ratio to PyTorch's Schedule1F1B.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
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


def data(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    return [(x, y)] * steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, ranks: int, port: int, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)


def _torch_rank(rank: int, ranks: int, port: int, args: dict[str, Any], out: Any) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    _init(rank, ranks, port, args["threads"])
    module = split(blocks(), ranks)[rank]
    stage = PipelineStage(module, rank, ranks, torch.device("cpu"))
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    cls = ScheduleGPipe if args["run"] == "torch ScheduleGPipe" else Schedule1F1B
    schedule = cls(stage, args["micro_batches"], loss_fn=nn.functional.cross_entropy)
    x, y = data(args["batch"], 1)[0]

    def step() -> None:
        if rank == 0:
            schedule.step(x)
        elif rank == ranks - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args["warmup"]):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args["steps"]):
        step()
    dist.barrier()
    if rank == 0:
        out.put(args["steps"] * args["batch"] / (time.perf_counter() - start))
    dist.destroy_process_group()


def _pipeoptim_rank(rank: int, ranks: int, port: int, args: dict[str, Any], out: Any) -> None:
    from pipeoptim import Pipeline
    from pipeoptim.plan.plan import OptimizerSpec

    _init(rank, ranks, port, args["threads"])
    method = args["run"].split()[-1]
    micro = args["micro_batches"] if method in ("gpipe", "1f1b", "zb-h1") else None
    pipe = Pipeline(
        blocks(),
        method,
        stages=ranks,
        micro_batches=micro,
        optimizer=OptimizerSpec("sgd", 0.01),
        transport="dist",
        device="cpu",
        targets="read",
        log_every=10**9,
    )
    pipe.fit(data(args["batch"], args["warmup"]), max_steps=args["warmup"])
    dist.barrier()
    start = time.perf_counter()
    total = args["warmup"] + args["steps"]
    pipe.fit(data(args["batch"], total), max_steps=total)
    dist.barrier()
    if rank == 0:
        out.put(args["steps"] * args["batch"] / (time.perf_counter() - start))
    pipe.close()


def _spawned(target: Callable[..., None], ranks: int, args: dict[str, Any]) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, ranks, port, args, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    rate = float(out.get(timeout=600))
    for p in procs:
        p.join(timeout=60)
    return rate


def limit(ranks: int, args: dict[str, Any]) -> float:
    """The whole model in this process on one thread, times the rank count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Sequential(*blocks())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = data(args["batch"], 1)[0]
        for i in range(args["warmup"] + args["steps"]):
            if i == args["warmup"]:
                start = time.perf_counter()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return ranks * args["steps"] * args["batch"] / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


RUNS = (
    "torch ScheduleGPipe",
    "torch Schedule1F1B",
    "pipeoptim gpipe",
    "pipeoptim 1f1b",
    "pipeoptim zb-h1",
    "pipeoptim pipedream",
    "pipeoptim pipeoptim",
    "limit",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="1 round of 8 steps")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset")
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
    }
    runs = [r for r in a.runs.split(",") if r]
    rates: dict[str, list[float]] = {r: [] for r in runs}
    for round_ in range(a.rounds):
        for run in runs:
            job = {**args, "run": run}
            if run == "limit":
                rate = limit(a.ranks, job)
            elif run.startswith("torch"):
                rate = _spawned(_torch_rank, a.ranks, job)
            else:
                rate = _spawned(_pipeoptim_rank, a.ranks, job)
            rates[run].append(rate)
            print(f"round {round_ + 1}: {run}: {rate:,.0f} samples/s", file=sys.stderr)
    print(
        f"# {platform.processor() or platform.machine()}, {cores} cores, torch "
        f"{torch.__version__}; {a.ranks} gloo ranks, batch {a.batch}, M = {a.micro_batches}, "
        f"{a.steps} timed steps, median of {a.rounds} interleaved rounds"
    )
    base = statistics.median(rates["torch Schedule1F1B"]) if "torch Schedule1F1B" in rates else 0
    print("| run | samples/s | vs torch Schedule1F1B |")
    print("|---|---|---|")
    for run, values in rates.items():
        med = statistics.median(values)
        ratio = f"{med / base:.2f}x" if base else "-"
        print(f"| {run} | {med:,.0f} | {ratio} |")
    if "limit" in rates and "pipeoptim pipeoptim" in rates:
        share = statistics.median(rates["pipeoptim pipeoptim"]) / statistics.median(rates["limit"])
        print(f"\npipeoptim at {share:.2f}x the {a.ranks}-stage limit (goal >= 0.95x)")


if __name__ == "__main__":
    main()
