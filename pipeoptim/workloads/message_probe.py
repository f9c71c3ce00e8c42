"""What a message costs a pipeline rank: a short run of the real runtime on two processes.

Why not gloo's cost alone: the ping-pong of :mod:`pipeoptim.runtime.profiling.messages`
times gloo moving a small tensor between two processes (about 40 µs at each end on a
2-core CPU box), but a pipeline rank spends more per message: the executor posts each
receive ahead, checks and records the payload, traces the action, and the transport wraps
gloo's call. On a small model that work, not gloo's, is most of a message, and the offline
cost model that charged gloo's alone predicted a 4-rank 1F1B run at 2.8x its throughput.

The probe measures what calibration would fit from a real run (:func:`pipeoptim.calibrate.
machine_fit`: at each end the mean work of a message with the executor's time before it),
on a run of the profiled model itself: its units split into two stages, one process each
over gloo, on cores of their own where the host has two (else they share the one, and the
fit counts that), trained with 1F1B and two micro-batches (one where the batch is odd) for a few
mini-batches. Starting
the two interpreters is most of its time (a few seconds). :func:`run_probe` runs any number
of such processes; :mod:`pipeoptim.workloads.layout_probe` runs one per planned rank.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from pipeoptim.calibrate import machine_fit
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.profiling.messages import wait_for_result
from pipeoptim.trace import Trace
from pipeoptim.workloads.loader import build_model, model_loss

__all__ = ["RuntimeMessages", "probe_messages", "run_probe"]

PROBE_METHOD = "1f1b"
PROBE_MICRO_BATCHES = 2


@dataclass(frozen=True)
class RuntimeMessages:
    """The runtime's fixed work per message, fitted from the probe's trace (seconds)."""

    send_s: float
    """At the sender: the send action and the executor's time before it."""
    receive_s: float
    """At the receiver: taking the message in once it arrived, and the time before."""
    mini_batches: int
    """Mini-batches the probe trained."""


def _probe_rank(
    rank: int,
    world: int,
    port: int,
    run: dict[str, Any],
    timeout: float,
    results: Any,
) -> None:
    """One of the probe's processes: its stage of ``run["model"]``, trained
    ``run["steps"]`` mini-batches; rank 0 saves the run's trace to ``run["trace"]`` and
    then puts True on ``results``."""
    torch.set_num_threads(1)  # as each of the ranks that share a 2-core host gets
    wait = timedelta(seconds=timeout)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
    group_store = PrefixStore("message-probe", store)
    dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world, timeout=wait)
    try:
        model, batch_size, steps = run["model"], run["batch_size"], run["steps"]
        layers, data = build_model(model, run["seed"])
        held = len(data.train_x) // batch_size  # the probe cycles through these
        batches = [
            (data.train_x[j : j + batch_size], data.train_y[j : j + batch_size])
            for j in ((i % held) * batch_size for i in range(steps))
        ]
        micro = run["micro_batches"]
        pipe = Pipeline(
            list(layers),
            PROBE_METHOD,
            stages=world,
            micro_batches=micro if batch_size % micro == 0 else 1,
            optimizer=OptimizerSpec(run["optimizer"], 1e-4),
            loss_fn=model_loss(model),
            transport="dist",
            device="cpu",
            seed=run["seed"],
            log_every=steps + 1,
        )
        trace = pipe.fit(batches, max_steps=steps).trace
        pipe.close()
        if rank == 0:
            trace.save(run["trace"])
            results.put(True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_probe(
    model: str,
    *,
    stages: int,
    micro_batches: int,
    batch_size: int,
    steps: int,
    optimizer: str = "sgd",
    seed: int = 0,
    timeout: float = 120.0,
) -> Trace:
    """The trace of ``model``'s units split evenly into ``stages`` stages, one spawned
    process each over gloo, trained with 1F1B and ``micro_batches`` micro-batches (one
    where they do not divide the batch) for ``steps`` mini-batches of its own training
    data. Raises ``RuntimeError`` where the processes cannot run it (spawning, gloo, a
    model the runtime refuses)."""
    import torch.multiprocessing as mp

    if steps < 4:
        raise ValueError(f"the probe needs 4 mini-batches or more for a steady state (got {steps})")
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    # port 0: the OS picks a free port as the store binds it, so nothing can race for it
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    with tempfile.TemporaryDirectory(prefix="pipeoptim-probe-") as folder:
        path = Path(folder) / "trace.json"
        run = {
            "model": model,
            "seed": seed,
            "optimizer": optimizer,
            "batch_size": batch_size,
            "steps": steps,
            "micro_batches": micro_batches,
            "trace": str(path),
        }
        procs = [
            context.Process(
                target=_probe_rank,
                args=(rank, stages, store.port, run, timeout, results),
                daemon=True,
            )
            for rank in range(stages)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        names = [f"the probe's rank {rank}" for rank in range(stages)]
        try:
            wait_for_result(results, procs, timeout, names)
        finally:
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
        return Trace.load(path)


def probe_messages(
    model: str,
    *,
    batch_size: int,
    steps: int,
    optimizer: str = "sgd",
    seed: int = 0,
    timeout: float = 120.0,
) -> RuntimeMessages:
    """The runtime's work per message on this host (module docstring): ``steps``
    mini-batches of ``batch_size`` samples of ``model``'s own training data (it must
    hold that many). Raises ``RuntimeError`` where the two processes cannot run it
    (spawning, gloo, a model the runtime refuses), with what they reported."""
    trace = run_probe(
        model,
        stages=2,
        micro_batches=PROBE_MICRO_BATCHES,
        batch_size=batch_size,
        steps=steps,
        optimizer=optimizer,
        seed=seed,
        timeout=timeout,
    )
    fit = machine_fit(trace)
    if fit is None:
        raise RuntimeError("the probe's trace showed no message between its two processes")
    return RuntimeMessages(float(fit.message_send_s), float(fit.message_receive_s), steps)
