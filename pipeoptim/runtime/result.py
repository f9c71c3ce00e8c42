"""What a training run returns: losses, evaluation, throughput, weight copies and the trace.

Each process measures its own share (:class:`~pipeoptim.runtime.executor.RankResult`, plain
JSON-able data); :func:`merge` combines the shares of every rank into one
:class:`FitResult`, whatever the transport, so a one-process run and a ``torchrun`` run
report alike.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeoptim.plan.machine import Machine, this_machine_cores
from pipeoptim.plan.plan import Plan
from pipeoptim.runtime.executor import RankResult
from pipeoptim.trace import Trace

__all__ = ["EvalResult", "FitResult", "build_trace", "merge"]


@dataclass(frozen=True)
class EvalResult:
    """Loss (and accuracy, for classifiers) of the live weights on an evaluation set."""

    loss: float
    """Mean loss over the samples (the loss function's mean, weighted by batch size)."""
    accuracy: float | None
    """Correct argmax predictions over targets (tokens for a language model); None where
    the output is not a score per class of each target."""
    samples: int
    step: int = 0
    """Mini-batches trained when it was measured."""

    @property
    def perplexity(self) -> float:
        """exp(loss): the language-model reading of a mean cross-entropy."""
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        return cls(float(d["loss"]), d["accuracy"], int(d["samples"]), int(d.get("step", 0)))


@dataclass
class FitResult:
    """The outcome of ``Pipeline.fit`` (and of ``pipeoptim train``), merged over ranks."""

    method: str
    num_stages: int
    micro_batches: int
    batch_size: int
    transport: str
    device: str
    start_step: int
    end_step: int
    steps_per_epoch: int
    losses: list[float]
    """Training loss of every mini-batch run (start_step .. end_step-1)."""
    final_loss: float
    """Mean training loss of the last (up to) 10 mini-batches."""
    train_accuracy: float | None
    """Accuracy over the last (up to) one epoch of mini-batches (None: not a classifier)."""
    eval: EvalResult | None
    """The evaluation at the end of the run, where ``eval_data`` was given."""
    eval_history: list[EvalResult]
    """Every evaluation of the run (``eval_every``), in order."""
    samples_per_second: float
    train_seconds: float
    weight_copies: dict[int, int]
    """Peak weight copies each stage held (live, stashed or buffered, predicted)."""
    skipped_samples: int
    """Samples per epoch left out (a partial last batch)."""
    notes: list[str]
    """Deviations and fallbacks the run reported (also issued as warnings)."""
    model: str = "custom"
    unwritten: list[str] = field(default_factory=list)
    """Output files that could not be written (the results above are complete)."""
    trace: Trace = field(default_factory=Trace, repr=False)

    @property
    def test_accuracy(self) -> float:
        """The final evaluation's accuracy (nan without one)."""
        if self.eval is None or self.eval.accuracy is None:
            return float("nan")
        return self.eval.accuracy

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("trace")
        d["test_accuracy"] = self.test_accuracy
        if self.eval is not None:
            d["eval"]["perplexity"] = self.eval.perplexity
        return d


def build_trace(plan: Plan, results: list[RankResult], meta: dict[str, Any]) -> Trace:
    """The run's Trace from every rank's events and memory samples."""
    shape = plan.shape(1)
    start = min((r.start_step for r in results), default=0)
    full = {
        "method": plan.method,
        "num_stages": shape.num_stages,
        "micro_batches": shape.micro_batches,
        "mini_batches": max((r.end_step for r in results), default=0) - start,
        "first_mini_batch": start,
        "batch_size": plan.batch_size,
        "source": "runtime",
        "units": {"time": "s", "bytes": "B"},
        "plan": plan.to_dict(),
        # measured peak, the same key the simulator writes, so metrics compare them
        "weight_copies": {
            str(k): n
            for k, n in sorted((k, n) for r in results for k, n in r.weight_copies.items())
        },
        # median seconds of one prediction per predicting stage: calibration separates it
        # from the forward it runs before
        "predict_s": {
            str(k): v for k, v in sorted((k, v) for r in results for k, v in r.predict_s.items())
        },
        # bytes of Ŵ a predicted forward's recomputed units hold, per stage (calibration)
        "recompute_held_bytes": {
            str(k): v
            for k, v in sorted((k, v) for r in results for k, v in r.recompute_held_bytes.items())
        },
        **next((r.meta for r in results if r.meta), {}),  # what a rank knows of the run
        **meta,
    }
    full.setdefault("machine", _machine_record(plan, full))
    return Trace(
        events=sorted((e for r in results for e in r.events), key=lambda e: (e.start, e.rank)),
        memory=sorted((m for r in results for m in r.memory), key=lambda m: (m.time, m.rank)),
        meta=full,
    )


def _machine_record(plan: Plan, meta: dict[str, Any]) -> dict[str, int]:
    """The host the ranks shared, for calibration (:class:`~pipeoptim.plan.machine.Machine`):
    this host's cores, the ranks on it (torchrun's LOCAL_WORLD_SIZE, else every rank of a
    multi-process run, which ``pipeoptim train`` spawns on this machine; 1 for one process)
    and each rank's threads."""
    replicas = meta.get("data_parallel")
    spawned = plan.shape(1).num_ranks * (replicas if isinstance(replicas, int) else 1)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    ranks = 1 if meta.get("transport") == "local" else int(local) if local else spawned
    threads = meta.get("threads")
    return Machine(
        cores=this_machine_cores(),
        ranks_per_host=max(1, ranks),
        threads_per_rank=threads if isinstance(threads, int) and threads >= 1 else 1,
    ).to_dict()


def merge(plan: Plan, results: list[RankResult], meta: dict[str, Any]) -> FitResult:
    """One FitResult from the shares of every rank (``meta``: transport, device, model)."""
    last = next((r for r in results if r.losses), results[-1])
    first = next((r for r in results if r.steps_per_epoch), results[0])
    steps = sorted(last.losses)
    losses = [last.losses[s] for s in steps]
    window = steps[-max(1, first.steps_per_epoch) :]
    right = [last.correct[s] for s in window if s in last.correct]
    counted = sum(last.targets.get(s, 0) for s in window)
    seconds = max(r.train_seconds for r in results)
    evals = [EvalResult.from_dict(e) for e in last.evals] or [
        EvalResult.from_dict(e) for r in results for e in r.evals
    ]
    final_eval = next((e for e in reversed(evals) if e.step == last.end_step), None)
    copies = {k: n for r in results for k, n in r.weight_copies.items()}
    shape = plan.shape(1)
    batch = plan.batch_size or first.batch_size
    return FitResult(
        method=plan.method,
        num_stages=shape.num_stages,
        micro_batches=shape.micro_batches,
        batch_size=batch,
        transport=str(meta.get("transport", "local")),
        device=str(meta.get("device", "cpu")),
        start_step=last.start_step,
        end_step=last.end_step,
        steps_per_epoch=first.steps_per_epoch,
        losses=losses,
        final_loss=sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan"),
        train_accuracy=sum(right) / counted if right and len(right) == len(window) else None,
        eval=final_eval,
        eval_history=evals,
        samples_per_second=(last.end_step - last.start_step) * batch / seconds
        if seconds > 0
        else 0.0,
        train_seconds=seconds,
        weight_copies=dict(sorted(copies.items())),
        skipped_samples=first.skipped_samples,
        notes=sorted({n for r in results for n in r.notes}),
        model=str(meta.get("model", "custom")),
        trace=build_trace(plan, results, meta),
    )
