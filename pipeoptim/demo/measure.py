"""The demo's measuring steps, with torch: profile the model (step 1), train two plans for
real, one process per stage (step 3), and train the same methods on one device for the
convergence comparison (step 5).

Each is a thin client of the public entry points a user would call (``profile_builtin``,
``workloads.train.train`` with a :class:`~pipeoptim.runtime.config.TrainConfig`,
``study.runs.run_one``), so the demo measures exactly what ``pipeoptim profile``,
``pipeoptim train --transport dist`` and ``pipeoptim compare`` measure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeoptim.demo.options import DemoOptions
from pipeoptim.demo.resume import write_atomic
from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile

__all__ = ["converge", "count_layers", "profile", "run_device", "train_for_real"]


def count_layers(model: str, seed: int) -> int:
    """The model's partition units (an unknown model name raises the loader's error)."""
    from pipeoptim.workloads.loader import build_model

    layers, _ = build_model(model, seed)
    return len(layers)


def run_device(stages: int) -> str:
    """Where the real runs go: ``auto`` (one GPU per rank, NCCL) when there are enough GPUs,
    else ``cpu`` (gloo), which every machine has."""
    import torch

    return "auto" if torch.cuda.device_count() >= stages else "cpu"


def profile(options: DemoOptions, path: Path) -> Profile:
    """Step 1: the model's per-layer costs under the conditions of a ``stages``-rank run on
    this machine (on CPU: the threads each rank gets, busy stand-ins for the others)."""
    from pipeoptim.workloads.profiling import profile_builtin

    device = run_device(options.stages)
    measured = profile_builtin(
        options.model,
        batch_size=options.batch_size,
        optimizer=options.optimizer,
        repeats=options.sizes.profile_repeats,
        device=None if device == "auto" else device,
        progress=sys.stderr.isatty(),
        seed=options.seed,
        ranks=options.stages,
    )
    write_atomic(path, measured.save)
    return measured


def train_for_real(
    options: DemoOptions, plan: Plan, trace_path: Path, steps: int
) -> dict[str, Any]:
    """Step 3 (one method): ``plan`` trained ``steps`` mini-batches by ``stages``
    processes over gloo (NCCL on GPUs), as ``pipeoptim train --transport dist`` runs it;
    the trace goes to ``trace_path`` (renamed into place only once the run has finished)."""
    from pipeoptim.runtime.config import TrainConfig
    from pipeoptim.workloads.train import train

    partial = trace_path.with_name(f".{trace_path.name}.partial")
    config = TrainConfig(
        plan,
        max_steps=steps,
        transport="dist",
        trace=str(partial),
        seed=options.seed,
        device=run_device(options.stages),
        quiet=not sys.stderr.isatty(),
        timeout=120.0,
    )
    result = train(config)
    if result is None:  # only under torchrun, which the demo never is
        raise PipeoptimError("pipeoptim demo starts its own processes; run it without torchrun")
    if result.unwritten:
        raise PipeoptimError(
            f"the run's trace could not be written to {str(partial)!r} "
            f"({'; '.join(result.notes)}); free some space in --out and run the demo again"
        )
    os.replace(partial, trace_path)
    ev = result.eval
    return {
        "method": result.method,
        "micro_batches": result.micro_batches,
        "steps": result.end_step - result.start_step,
        "samples_per_second": result.samples_per_second,
        "train_seconds": result.train_seconds,
        "final_loss": result.final_loss,
        "losses": result.losses,
        "test_loss": ev.loss if ev else None,
        "test_accuracy": ev.accuracy if ev else None,
        "weight_copies": [result.weight_copies[k] for k in sorted(result.weight_copies)],
        "device": result.device,
        "notes": list(result.notes),
    }


def converge(options: DemoOptions, method: str) -> dict[str, Any]:
    """Step 5 (one method): the study's run of ``method`` with every stage in this process
    (bitwise equal to the distributed run), evaluated every ``eval_every`` mini-batches."""
    from pipeoptim.study.runs import MODEL_METRIC, RunSpec, run_one

    sizes = options.sizes
    spec = RunSpec(
        model=options.model,
        method=method,
        optimizer=options.optimizer,
        lr=options.lr,
        stages=options.stages,
        seed=options.seed,
        steps=sizes.converge_steps,
        eval_every=sizes.eval_every,
        batch_size=options.batch_size,
        eval_samples=sizes.eval_samples,
    )
    with _elapsed(f"convergence of {method}"):
        record = run_one(spec)
    return {
        "method": method,
        "micro_batches": spec.micro_batches,
        "metric": MODEL_METRIC.get(options.model, "accuracy"),
        "curve": [
            {
                "step": p.step,
                "samples": p.samples,
                "train_loss": p.train_loss,
                "test_loss": p.test_loss,
                "test_metric": p.test_metric,
            }
            for p in record.curve
        ],
        "diverged_at": record.diverged_at,
        "seconds": record.seconds,
    }


@contextlib.contextmanager
def _elapsed(what: str) -> Iterator[None]:
    """A bar that shows the time spent so far (on a terminal), for work that reports no
    progress of its own (a whole convergence run is one call)."""
    from tqdm import tqdm

    bar = tqdm(
        desc=what, bar_format="{desc}: {elapsed}", file=sys.stderr, disable=None, leave=False
    )
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            bar.refresh()

    thread = threading.Thread(target=tick, name="pipeoptim-demo-elapsed", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.close()
