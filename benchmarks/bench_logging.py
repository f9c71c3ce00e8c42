"""What watching a fit costs: the same fit with no logger, with the TensorBoard and JSON-lines
loggers, and with a callback that may stop (so stop decisions travel at every log point),
as ratios of step time to the bare fit, measured in one run (median of interleaved rounds).

Run from the repository root::

    .venv/bin/python benchmarks/bench_logging.py            # 4 stages, 5 rounds (~1 minute)
    .venv/bin/python benchmarks/bench_logging.py --quick    # fewer steps and rounds

The model is 8 x Linear(256) + ReLU and a head on 4 stages (pipeoptim, local transport),
batch 64, ``log_every=10``. Goal: every ratio within noise of 1 (the loggers read only what
the fit loop reads anyway).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeoptim import Callback, JsonlLogger, Pipeline, TensorBoardLogger


class NeverStops(Callback):
    """May stop, never does: the fit exchanges stop decisions at every log point."""

    def on_step_end(self, info: Any, pipeline: Any) -> None:
        if info.losses and min(info.losses.values()) < -1.0:
            info.request_stop("never")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g))] * steps


def one_fit(case: str, steps: int, folder: Path) -> float:
    watchers: dict[str, list[Any]] = {
        "bare": [],
        "tensorboard+jsonl": [TensorBoardLogger(folder / "tb"), JsonlLogger(folder / "r.jsonl")],
        "may-stop callback": [NeverStops()],
    }
    pipe = Pipeline(model(), "pipeoptim", stages=4, log_every=10, callbacks=watchers[case])
    batches = data(steps)
    started = time.perf_counter()
    pipe.fit(batches, max_steps=steps)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    rounds, steps = (2, 40) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(1)
    cases = ("bare", "tensorboard+jsonl", "may-stop callback")
    times: dict[str, list[float]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for case in cases:
                times[case].append(one_fit(case, steps, Path(tmp) / f"{r}-{case}"))
    bare = statistics.median(times["bare"])
    print(f"step time, median of {rounds} interleaved rounds of {steps} steps:")
    for case in cases:
        t = statistics.median(times[case])
        print(f"  {case:18s} {t * 1e3:8.2f} ms   {t / bare:5.3f}x bare")


if __name__ == "__main__":
    main()
