"""How well the simulator predicts real runs: offline, self-calibrated and across methods.

Run from the repository root::

    .venv/bin/python benchmarks/bench_fidelity.py            # 3 runs of 60 steps (~2 min)
    .venv/bin/python benchmarks/bench_fidelity.py --quick    # 20 steps each

Workload: ``benchmarks/fidelity_model.py`` (8 x Linear(1024) + ReLU and a head), batch 256,
2 stages as 2 gloo processes on this machine (``pipeoptim train --transport dist``), SGD
with momentum. Methods: 1f1b (M = 4), pipedream and pipeoptim (M = 1).

For each method the measured time per mini-batch (steady state) is set against:

* **offline**: the profile (``pipeoptim profile --ranks 2``: one thread per rank on a 2-core
  machine, times at 256, 128, 64 and 32 samples, optimizer step and prediction timed) cut at
  the run's boundaries, simulated for the run's shape;
* **self-calibrated**: ``pipeoptim calibrate`` of the run's own trace;
* **cross-method**: ``calibrate --predict`` from each other method's trace.

It also sets the predicted peak memory of the fullest rank and the bubble ratio (offline
and calibrated) against the run's. Goals on CPU: offline <= 20%, self-calibrated <= 10%,
cross-method <= 15% on time per mini-batch; memory <= 15%; bubble ratio <= 20% relative.
``--device cuda`` runs both stages in one process on one GPU (``--transport local``).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pipeoptim.calibrate import calibrate, run_boundaries, what_if
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.profile import Profile
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.trace import Trace

MODEL = "benchmarks/fidelity_model.py:build"
BATCH = 256
METHODS = {"1f1b": 4, "pipedream": 1, "pipeoptim": 1}
GOALS = {"offline": 0.20, "self": 0.10, "cross": 0.15, "memory": 0.15, "bubble": 0.20}


def train(
    method: str,
    micro_batches: int,
    steps: int,
    trace: Path,
    transport: str,
    device: str,
    *,
    model: str = MODEL,
    stages: int = 2,
    batch: int = BATCH,
) -> Trace:
    argv = [sys.executable, "-m", "pipeoptim", "train", "--model", model, "--method", method]
    argv += ["--stages", str(stages), "--transport", transport, "--batch-size", str(batch)]
    argv += ["--max-steps", str(steps), "--trace", str(trace), "--quiet", "--device", device]
    if get_method(method).micro_batched_by_default:
        argv += ["--micro-batches", str(micro_batches)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return Trace.load(trace)


def per_batch(trace: Trace) -> float:
    metrics = compute_metrics(trace)
    return float(trace.meta.get("batch_size") or BATCH) / metrics.steady_throughput


def peak(trace: Trace) -> int:
    return compute_metrics(trace).peak_memory_bytes or 0


def offline(profile: Profile, measured: Trace, method: str, micro_batches: int) -> Trace:
    spec = get_method(method)
    shape = spec.shape(2, micro_batches if spec.micro_batched_by_default else None, 60)
    costs = CostModel.from_profile(
        profile, run_boundaries(measured), shape.micro_batches, batch_size=BATCH
    )
    predicted = evaluate_trace(spec, shape, costs)
    predicted.meta["batch_size"] = BATCH
    return predicted


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="mini-batches per run")
    parser.add_argument("--quick", action="store_true", help="20 steps per run")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (2 gloo processes) or cuda (both stages in one process on one GPU)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep traces and profile here")
    parser.add_argument(
        "--reuse", action="store_true", help="with --keep: read the runs kept there, rerun none"
    )
    args = parser.parse_args(argv)
    steps = 20 if args.quick else args.steps
    cuda = args.device.startswith("cuda")
    transport = "local" if cuda else "dist"
    where_run = f"one GPU ({torch.cuda.get_device_name()})" if cuda else "2 gloo ranks"
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{where_run}, batch {BATCH}, {steps} steps per run"
    )
    from pipeoptim.workloads.profiling import profile_builtin

    profile = profile_builtin(
        MODEL, batch_size=BATCH, ranks=None if cuda else 2, repeats=5, device=args.device
    )
    sizes = profile.meta["batch_sizes"]
    print(f"profile: {profile.meta['threads']} thread(s), batch sizes {sizes}")
    traces: dict[str, Trace] = {}
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        profile.save(where / "profile.json")
        for method, m in METHODS.items():
            kept = where / f"{method}.json"
            if args.reuse and kept.exists():
                traces[method] = Trace.load(kept)
            else:
                traces[method] = train(method, m, steps, kept, transport, args.device)
            print(f"ran {method}: {per_batch(traces[method]) * 1e3:.1f} ms per mini-batch")
    errors: dict[str, list[float]] = {key: [] for key in GOALS}
    print()
    print(
        "| method | measured ms | offline | self-calibrated | cross-method (from) | "
        "memory offline | memory calibrated | bubble offline | bubble calibrated |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for method, m in METHODS.items():
        measured = traces[method]
        time = per_batch(measured)
        guess = offline(profile, measured, method, m)
        off = error(per_batch(guess), time)
        _, rows = calibrate(measured)
        row = {r.quantity: r for r in rows}
        mine = row["time per mini-batch (steady state)"].relative_error
        cross = []
        for other in METHODS:
            if other == method:
                continue
            predicted = what_if(
                traces[other], method, micro_batches=m if m > 1 else None, profile=profile
            )
            cross.append((other, error(predicted.time_per_mini_batch, time)))
        mem_off = error(peak(guess), peak(measured))
        mem_cal = row["peak memory, fullest rank"].relative_error
        bubble_off = error(compute_metrics(guess).bubble_ratio, row["bubble ratio"].measured)
        bubble_cal = row["bubble ratio"].relative_error
        errors["offline"].append(off)
        errors["self"].append(mine)
        errors["cross"] += [e for _, e in cross]
        errors["memory"] += [mem_off, mem_cal]
        errors["bubble"] += [bubble_off, bubble_cal]
        crossed = ", ".join(f"{e:+.1%} ({o})" for o, e in cross)
        print(
            f"| {method} | {time * 1e3:.1f} | {off:+.1%} | {mine:+.1%} | {crossed} | "
            f"{mem_off:+.1%} | {mem_cal:+.1%} | {bubble_off:+.1%} | {bubble_cal:+.1%} |"
        )
    print()
    for key, goal in GOALS.items():
        worst = max(abs(e) for e in errors[key])
        verdict = "met" if worst <= goal else "MISSED"
        print(f"goal {key} <= {goal:.0%}: worst {worst:.1%}, {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
