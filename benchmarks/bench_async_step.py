"""What a training step of the micro-batched asynchronous methods costs beside gpipe's.

Run from the repository root::

    .venv/bin/python benchmarks/bench_async_step.py             # P = 4, 8, 16; 5 rounds (~4 min)
    .venv/bin/python benchmarks/bench_async_step.py --old-path  # and the path before issue 34
    .venv/bin/python benchmarks/bench_async_step.py --quick     # P = 4 and 16, 1 round, 6 steps
    .venv/bin/python benchmarks/bench_async_step.py --micro-factor 4  # M = 4P: 1F1B's steady state
    .venv/bin/python benchmarks/bench_async_step.py --replay    # and each order in plain torch
    .venv/bin/python benchmarks/bench_async_step.py --forwards-first  # and forwards first

Why: XPipe is the asynchronous method that converges under AdamW at 8 and 16 stages
(``docs/choosing-a-method.md``), and a forward on a weight version other than the live one
(XPipe's prediction Ŵ, 2BW's previous buffer) runs the stage's units on aliases of that
version. Where that costs more than the layers, the method users should run at depth is the
slowest to run (issue 34). Goal: xpipe's step at most 1.15x gpipe's at 16 stages.

Workload: the convergence study's (``gpt-deep``: 17 units, 365k weights; batch 32 of 32
characters; AdamW 2e-3 with weight decay 0.01, warm-up and cosine, clipping 1.0), every
stage in one process (the local transport), one thread. gpipe, 2bw and xpipe run M = P
micro-batches, pipeoptim runs whole mini-batches (M = 1), as in the study. A method's step
cost is the CPU time of a fit of ``--steps`` steps on a fresh pipeline (built and warmed up by
a first step outside the clock), divided by the steps. On the local transport every stage
runs in one thread, so a bubble costs no CPU time: the step is the work of every stage plus
the executor's, the fill and the drain included. Each round runs every method once at every
depth, interleaved; the table gives each method's median step and the median over the rounds of its
step over gpipe's in the same round. ``--old-path`` adds each asynchronous method on the
forward path before issue 34 (``old_async_path.py``: ``functional_call`` on fresh aliases,
Ŵ written and hooked for every micro-batch), same run, same rounds.

``--replay`` separates the order from pipeoptim: it records the forwards, backwards and
updates each method's local run makes, in the order it makes them, and replays that order
in plain torch (the same units as ``nn.Sequential`` stages, ``autograd.backward``, an AdamW
step per stage; no versions, no executor, no messages), timed the same way in the same
rounds. Its column is the replayed step over gpipe's replayed step: what running the
stages in that order costs by itself on this machine.

``--forwards-first`` adds each method run with ``Pipeline(forwards_first=True)`` (path
``forwards first``), same rounds: each rank's forwards between two of its updates back to
back, then its backwards, the same weights bit for bit (``plan.passes.forwards_first``).
gpipe's order is that already.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
import warnings
from contextlib import AbstractContextManager, nullcontext

import torch
from old_async_path import old_path
from torch.optim.lr_scheduler import LambdaLR

from pipeoptim.plan.actions import Action, Kind
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.lr import WarmupCosine
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.workloads.data import DatasetLoader
from pipeoptim.workloads.loader import build_model, model_loss

METHODS = ("gpipe", "2bw", "xpipe", "pipeoptim", "1f1b")
"""What the table can show; 1f1b (the synchronous 1F1B order) only when asked for."""
MODEL, BATCH = "gpt-deep", 32


PATHS = ("fast", "old", "forwards first")
"""How a method runs: today's path, the path before issue 34, today's with each rank's
forwards first (``Pipeline(forwards_first=True)``)."""


def step_seconds(
    method: str, stages: int, steps: int, path: str = "fast", factor: int = 1
) -> float:
    """CPU seconds per step of a ``fit`` of ``steps`` mini-batches on a fresh pipeline on
    ``path`` (:data:`PATHS`; built on it too); the micro-batched methods run M = ``factor``
    x P micro-batches of a batch ``factor`` times as large. CPU time, not wall time: the
    machine is shared, and the wall clock would count the other users' work as ours."""
    context: AbstractContextManager[None] = old_path() if path == "old" else nullcontext()
    with context:
        pipe, train = _pipeline(method, stages, factor, path == "forwards first")
        pipe.fit(train, max_steps=1)
        start = time.process_time()
        pipe.fit(train, max_steps=1 + steps)
        return (time.process_time() - start) / steps


def _pipeline(
    method: str, stages: int, factor: int, forwards_first: bool = False
) -> tuple[Pipeline, DatasetLoader]:
    """A fresh pipeline of the workload and its data."""
    layers, data = build_model(MODEL, 0)
    micro = factor * stages if get_method(method).micro_batched_by_default else 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the depth advice for methods that stall at depth
        pipe = Pipeline(
            list(layers),
            method=method,
            stages=stages,
            micro_batches=micro,
            optimizer=OptimizerSpec("adamw", 2e-3, {"weight_decay": 0.01}),
            scheduler=functools.partial(LambdaLR, lr_lambda=WarmupCosine(10, 1000, 0.1)),
            grad_clip=1.0,
            loss_fn=model_loss(MODEL),
            log_every=10**9,
            forwards_first=forwards_first,
        )
    return pipe, DatasetLoader(data.train_x, data.train_y, factor * BATCH, seed=0)


def recorded_order(
    method: str, stages: int, steps: int, factor: int = 1, forwards_first: bool = False
) -> tuple[list[Action], list[tuple[int, int]], int]:
    """The forwards, backwards and updates a local fit of ``steps`` mini-batches runs, in
    the order it runs them (the dry run left out); the stages' unit ranges; the micro-batch
    size."""
    from pipeoptim.runtime import executor

    pipe, train = _pipeline(method, stages, factor, forwards_first)
    pipe.fit(train, max_steps=1)
    seen: list[Action] = []
    step = executor.RankExecutor.step

    def recording(self: executor.RankExecutor) -> None:
        a = self.next_action()
        if a is not None and a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.UPDATE):
            seen.append(a)
        step(self)

    executor.RankExecutor.step = recording  # type: ignore[method-assign]
    try:
        pipe.fit(train, max_steps=1 + steps)
    finally:
        executor.RankExecutor.step = step  # type: ignore[method-assign]
    micro = pipe.parts.shape.micro_batches
    return seen, [tuple(b) for b in pipe.parts.bounds], factor * BATCH // micro


def replay_seconds(
    order: list[Action], bounds: list[tuple[int, int]], micro: int, steps: int
) -> float:
    """CPU seconds per step of ``order`` run in plain torch (see the module's docstring)."""
    layers, data = build_model(MODEL, 0)
    units = list(layers)
    stages = [torch.nn.Sequential(*units[a:b]) for a, b in bounds]
    # An update steps a copy of the stage's weights with its gradients: the same work in
    # the same place of the order, while the graphs in flight keep the weights they saved
    # (keeping versions apart is pipeoptim's work, which the replay leaves out).
    params = [list(s.parameters()) for s in stages]
    copies = [[p.detach().clone() for p in ps] for ps in params]
    optimizers = [torch.optim.AdamW(c, lr=2e-3, weight_decay=0.01) for c in copies]
    loss_fn = model_loss(MODEL)
    x, y = data.train_x[:micro], data.train_y[:micro]
    last = len(stages) - 1
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    start = time.process_time()
    for a in order:
        k = a.stage
        if a.kind is Kind.FORWARD:
            given = x if k == 0 else outputs[(k - 1, a.mb)].detach().requires_grad_()
            inputs[(k, a.mb)] = given
            outputs[(k, a.mb)] = stages[k](given)
        elif a.kind is Kind.BACKWARD:
            out = outputs.pop((k, a.mb))
            if k == last:
                loss_fn(out, y).backward()
            else:
                out.backward(inputs.pop((k + 1, a.mb)).grad)
        else:
            for p, c in zip(params[k], copies[k], strict=True):
                c.grad, p.grad = p.grad, None
            optimizers[k].step()
    return (time.process_time() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="P = 4 and 16, 1 round, 6 steps")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24, help="timed steps per fit")
    parser.add_argument("--methods", nargs="+", default=list(METHODS[:4]), choices=METHODS)
    parser.add_argument(
        "--old-path", action="store_true", help="also the asynchronous methods before issue 34"
    )
    parser.add_argument(
        "--micro-factor",
        type=int,
        default=1,
        help="M = this x P micro-batches, batch this x 32 (same micro-batch size): at 4, "
        "1F1B's steady state, not its fill and drain, makes most of a step",
    )
    parser.add_argument(
        "--forwards-first",
        action="store_true",
        help="also each method with each rank's forwards first (path 'forwards first')",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="also each method's recorded order replayed in plain torch (rows 'replay')",
    )
    a = parser.parse_args()
    if a.micro_factor < 1:
        parser.error(
            f"--micro-factor must be 1 or more (got {a.micro_factor}): the micro-batched "
            f"methods run that many times P micro-batches; use 1 for M = P"
        )
    if a.quick:
        a.stages, a.rounds, a.steps = [4, 16], 1, 6
    runs = [("gpipe", "fast")]
    for m in (m for m in a.methods if m != "gpipe"):
        runs.append((m, "fast"))
        if a.old_path and get_method(m).asynchronous:  # flush methods: the same path either way
            runs.append((m, "old"))
        if a.forwards_first:
            runs.append((m, "forwards first"))
    torch.set_num_threads(1)
    replayed = [(m, path) for m, path in runs if path != "old"] if a.replay else []
    orders = {
        (p, m, path): recorded_order(m, p, a.steps, a.micro_factor, path == "forwards first")
        for p in a.stages
        for m, path in replayed
    }
    steps: dict[tuple[int, str, str], list[float]] = {}
    ratios: dict[tuple[int, str, str], list[float]] = {}
    for _ in range(a.rounds):
        for p in a.stages:
            this_round = {
                (m, path): step_seconds(m, p, a.steps, path, a.micro_factor) for m, path in runs
            }
            for m, path in replayed:
                replay = "replay" if path == "fast" else f"replay, {path}"
                this_round[(m, replay)] = replay_seconds(*orders[(p, m, path)], a.steps)
            for (m, path), seconds in this_round.items():
                base = this_round[("gpipe", "replay" if path.startswith("replay") else "fast")]
                steps.setdefault((p, m, path), []).append(seconds)
                ratios.setdefault((p, m, path), []).append(seconds / base)
    print(
        f"# {MODEL}, batch {a.micro_factor * BATCH}, M = {a.micro_factor} x P for the "
        f"micro-batched methods, local transport, one thread; torch {torch.__version__}, "
        f"{platform.machine()}; CPU time of fits of {a.steps} steps, median of {a.rounds} "
        f"interleaved round(s)"
    )
    print("| stages | method | path | ms per step | vs gpipe |")
    print("|---|---|---|---|---|")
    for p in a.stages:
        for m, path in (key[1:] for key in steps if key[0] == p):
            ms = 1e3 * statistics.median(steps[(p, m, path)])
            ratio = statistics.median(ratios[(p, m, path)])
            print(f"| {p} | {m} | {path} | {ms:.1f} | {ratio:.2f}x |")
    if a.replay:
        print(
            "\n'replay': the method's own order of forwards, backwards and updates in plain "
            "torch, against gpipe's order replayed alike"
        )


if __name__ == "__main__":
    main()
