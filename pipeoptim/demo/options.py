"""What one demo runs: the model, the pipeline depth and the sizes of every step.

The sizes are chosen so the default (the digits MLP on 4 stages) finishes in under three
minutes on a 2-core machine and ``--quick`` (2 stages, a few dozen mini-batches) in well
under a minute; a larger model gets fewer steps. Every check of the command line lives
here and runs before any work, so bad input stops at once with one line.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeoptim.errors import OutputPathError, PipeoptimError

__all__ = ["MAX_STAGES", "DemoOptions", "Sizes", "check_out_dir", "check_stages", "sizes_for"]

MAX_STAGES = 16
"""The demo starts one process per stage on this machine (each loads torch, a few hundred
MB); deeper pipelines are for ``pipeoptim plan`` and ``simulate``, which start none."""


@dataclass(frozen=True)
class Sizes:
    """How much work each step does."""

    profile_repeats: int
    """Timed runs per layer (the profile keeps the median)."""
    train_steps: int
    """Most mini-batches of each real (multi-process) run."""
    converge_steps: int
    """Mini-batches of each one-device convergence run."""
    eval_every: int
    """Mini-batches between the convergence runs' test evaluations."""
    eval_samples: int | None = None
    """Test samples each evaluation reads (None: all)."""
    train_min_steps: int | None = None
    """Fewest mini-batches of each real run (None: :attr:`train_steps`, a fixed count)."""
    train_budget_s: float = 4.0
    """Seconds the slower of the two real runs is predicted to train: both run that many
    mini-batches, within :attr:`train_min_steps` and :attr:`train_steps`. A real run
    measures the steady throughput the prediction is compared with; on a shared machine
    another tenant's burst of a tenth of a second moves a run of half a second by a third
    (the digits MLP's 120 mini-batches of 32 took 0.3 to 1 s on 2 cores and measured 7,107
    to 14,831 samples/s over eight identical demos), and seconds average it out."""

    def train_steps_for(self, samples_per_s: float, batch_size: int) -> int:
        """Mini-batches of each real run where the slower is predicted to train
        ``samples_per_s`` samples of ``batch_size`` a second (:attr:`train_budget_s`)."""
        low = self.train_steps if self.train_min_steps is None else self.train_min_steps
        if not math.isfinite(samples_per_s) or samples_per_s <= 0:
            return low
        wanted = math.ceil(self.train_budget_s * samples_per_s / batch_size)
        return max(low, min(self.train_steps, wanted))


_SIZES = {
    # digits (1,437 training samples): 300 steps of 32 is about 7 epochs
    "default": Sizes(
        profile_repeats=5,
        train_steps=600,
        converge_steps=300,
        eval_every=30,
        train_min_steps=120,
    ),
    "quick": Sizes(profile_repeats=2, train_steps=16, converge_steps=40, eval_every=10),
    # a transformer step costs tens of times an MLP step
    "gpt": Sizes(
        profile_repeats=3, train_steps=30, converge_steps=120, eval_every=30, eval_samples=64
    ),
    "gpt-quick": Sizes(
        profile_repeats=2, train_steps=8, converge_steps=16, eval_every=8, eval_samples=16
    ),
}


def sizes_for(model: str, quick: bool) -> Sizes:
    """The step sizes of ``model`` (``--quick``: the smallest that still shows each part)."""
    if model == "gpt":
        return _SIZES["gpt-quick" if quick else "gpt"]
    return _SIZES["quick" if quick else "default"]


@dataclass(frozen=True)
class DemoOptions:
    """One demo: the model and the pipeline, the optimizer, the sizes, where it writes."""

    out: Path
    model: str = "mlp"
    stages: int = 4
    optimizer: str = "sgd"
    lr: float = 0.02
    batch_size: int = 32
    seed: int = 0
    quick: bool = False
    sizes: Sizes = _SIZES["default"]

    def describe(self) -> dict[str, Any]:
        """The options as plain data (what the step fingerprints read)."""
        data = asdict(self)
        data["out"] = str(self.out)
        return data


def check_stages(stages: int) -> None:
    """Refuse a stage count the demo cannot run: below 1, or more processes than it starts."""
    if stages < 1:
        raise PipeoptimError(
            f"--stages must be at least 1 (got {stages}): it is the number of pipeline "
            f"stages, one process each; e.g. --stages 4"
        )
    if stages > MAX_STAGES:
        raise PipeoptimError(
            f"--stages must be at most {MAX_STAGES} for the demo (got {stages}), which starts "
            f"one process per stage on this machine; plan deeper pipelines without running "
            f"them: pipeoptim plan --model MODEL --stages {stages}"
        )


def check_out_dir(out: Path) -> None:
    """Refuse an ``--out`` that is a file or cannot become a writable folder."""
    text = str(out)
    if out.exists() and not out.is_dir():
        raise OutputPathError(
            f"--out {text!r} is a file, not a folder; give a folder for the demo's files "
            f"(it is created if missing), e.g. --out pipeoptim-demo"
        )
    existing = next((p for p in (out.absolute(), *out.absolute().parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise OutputPathError(
            f"--out {text!r}: {str(existing)!r} is a file, not a folder; choose another path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(
            f"--out {text!r}: cannot create or write it under {str(existing)!r}; give a "
            f"folder you can write"
        )
