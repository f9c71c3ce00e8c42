"""The check to run on the first GPU: every runtime path this project wrote for CUDA, run
as a user runs it (``Pipeline``, every stage in this one process on one device, the local
transport), with one table and one JSON of what it found.

    python benchmarks/gpu_check.py                       # on a GPU: under 8 minutes
    python benchmarks/gpu_check.py --quick               # tiny sizes, a minute or less
    python benchmarks/gpu_check.py --device cpu --quick  # the CPU fallback CI runs

Sections, in order (each row of the table is one check, ``pass``, ``fail``, ``skip`` with
its reason, ``info`` for a figure that is reported and not bounded, or ``error`` with the
exception, so one failure does not hide the others):

1. ``losses fp32``: every registered method (the registry, so a method added later is
   covered), each with the stages per rank and micro-batches its rules ask for: its first
   ``--steps`` losses on the device against the same run on the CPU and against the CPU's
   float64 run, within the tolerance ``gpu_check_runs.loss_tolerance`` derives from the
   number format (its module docstring says how);
2. ``bf16 autocast``: 1f1b under ``amp="bf16"`` against the float64 run, the bound widened
   by bf16's round-off;
3. ``recompute full``: 1f1b with every unit recomputed against none: the same losses, and no
   more memory (the allocator's peak on CUDA, the runtime's count on CPU);
4. ``sharded state D=2``: ZeRO-1 over two replicas, one process and one GPU each (NCCL),
   against the same run unsharded; skipped, with the reason, where two GPUs are not visible;
5. ``memory model``: the simulator's per-stage peaks on the run's own costs (as
   ``pipeoptim calibrate`` computes them) against ``torch.cuda.max_memory_allocated`` (one
   process holds every stage, so the device's peak lies between the largest stage's and
   their sum) or, on CPU, the runtime's own count per stage, for one method of each weight
   policy and stage layout;
6. ``calibrated simulator``: each method's run calibrated from its trace
   (``pipeoptim.calibrate.calibrate``), its predicted time per mini-batch and throughput
   against the run's;
7. ``vs PyTorch``: each synchronous method against the ``torch.distributed.pipelining``
   schedule that runs it in one process (every stage on one rank of a group of one), the
   same split, micro-batches and optimizer: samples/s of both and their losses. PyTorch's
   single-stage schedules (``ScheduleGPipe``, ``Schedule1F1B``) hold one stage per rank and
   need a process per stage, so 1f1b's row says so; gpipe is paired with
   ``ScheduleLoopedBFS``, whose order on one rank is GPipe's.

``--budget`` seconds bound the whole check: before each run it asks whether the longest run
so far still fits, and where it does not it stops, writes what it has and says what it
left out. The JSON (``--out``) is written after every section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("out") / "gpu-check"


class Budget:
    """Seconds left before ``limit``: a run starts only where the longest so far still fits."""

    def __init__(self, limit: float) -> None:
        self.start = time.perf_counter()
        self.limit = limit
        self.longest = 0.0
        self.left_out: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, what: str) -> bool:
        if self.left_out or self.elapsed() + self.longest > self.limit:
            self.left_out.append(what)
            return False
        return True

    def took(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


class Report:
    """The rows found so far, the progress lines, and the JSON file."""

    def __init__(self, device: str, size: Any, budget: Budget, out: Path) -> None:
        self.device, self.size, self.budget, self.out = device, size, budget, out
        self.rows: list[dict[str, Any]] = []

    def add(self, entry: dict[str, Any]) -> None:
        self.rows.append(entry)
        print(
            f"[{self.budget.elapsed():6.1f}s] {entry['check']} {entry['subject']}: "
            f"{entry['status']}  {entry['measured']}",
            file=sys.stderr,
            flush=True,
        )

    @contextlib.contextmanager
    def item(self, check: str, subject: str) -> Iterator[None]:
        """One timed piece of work; an exception becomes an ``error`` row."""
        start = time.perf_counter()
        try:
            yield
        except Exception as e:  # the check goes on: one failure must not hide the rest
            last = traceback.format_exc().strip().splitlines()[-1]
            self.add(
                {
                    "check": check,
                    "subject": subject,
                    "status": "error",
                    "measured": f"{type(e).__name__}: {str(e)[:200]}",
                    "bound": "-",
                    "values": {"traceback_tail": last},
                }
            )
        finally:
            self.budget.took(time.perf_counter() - start)

    def record(self) -> dict[str, Any]:
        import torch

        cuda = self.device.startswith("cuda")
        from gpu_check_runs import loss_tolerance

        return {
            "device": self.device,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "size": dataclasses.asdict(self.size),
            "tolerance": {
                "rule": "relative, step t: (t+1) x (layers x gamma(width) + gamma(10)), "
                "gamma(n) = n u / (1 - n u), u = 2^-24; bf16 adds 2 x 2^-8 per layer; "
                "two fp32 runs: twice that",
                "fp32_step0": loss_tolerance(self.size, 0),
                "bf16_step0": loss_tolerance(self.size, 0, "bf16"),
            },
            "budget_s": self.budget.limit,
            "elapsed_s": self.budget.elapsed(),
            "left_out": self.budget.left_out,
            "rows": self.rows,
        }

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.out.with_suffix(".part")
        temporary.write_text(json.dumps(self.record(), indent=2))
        temporary.replace(self.out)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The report as one markdown table."""
    lines = ["| check | subject | status | measured | bound | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        note = r["values"].get("note", "") if r["status"] != "error" else ""
        cells = [r["check"], r["subject"], r["status"], r["measured"], r["bound"], note]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CI fallback's)")
    parser.add_argument("--steps", type=int, help="mini-batches whose losses are compared")
    parser.add_argument("--methods", help="comma-separated (default: every registered method)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check")
    parser.add_argument("--out", type=Path, help=f"the JSON (default {DEFAULT_OUT}/<device>.json)")
    return parser.parse_args(argv)


def chosen_methods(names: str | None) -> list[str]:
    """The methods named (comma-separated), else every registered one, read when called so
    that a method registered later is in."""
    from pipeoptim.plan.methods.registry import METHODS

    return list(METHODS) if not names else names.split(",")


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--sharded-worker":
        from gpu_check_sections import sharded_worker

        sharded_worker("--shard" in sys.argv, int(sys.argv[2]), Path(sys.argv[3]))
        return 0
    args = parse(argv)
    import gpu_check_sections as sections
    import torch
    from gpu_check_runs import FULL, QUICK

    from pipeoptim.plan.methods.registry import METHODS

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: device {args.device!r}, but torch sees no GPU (torch "
            f"{torch.__version__}); run it where one is, or pass --device cpu",
            file=sys.stderr,
        )
        return 2
    methods = chosen_methods(args.methods)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or (args.steps is not None and args.steps < 1):
        print(
            f"gpu_check: unknown methods {unknown} or --steps below 1; methods: "
            f"{', '.join(METHODS)}",
            file=sys.stderr,
        )
        return 2
    if args.device.startswith("cuda"):  # the allocator's statistics read this device
        torch.cuda.set_device(torch.device(args.device))
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products in fp32: the bound's u
    torch.backends.cudnn.allow_tf32 = False
    size = QUICK if args.quick else FULL
    if args.steps:
        size = dataclasses.replace(size, steps=args.steps)
    out = args.out or DEFAULT_OUT / f"{args.device.replace(':', '-')}.json"
    report = Report(args.device, size, Budget(args.budget), out)
    print(f"gpu_check on {args.device}: {len(methods)} methods, sizes {size}", file=sys.stderr)
    sections.check_losses(report, methods)
    report.write()
    sections.check_precision(report, "1f1b")
    sections.check_recompute(report, "1f1b")
    sections.check_sharded(report, str(Path(__file__).resolve()))
    report.write()
    sections.check_memory(report, sections.one_method_per_weight_policy(methods))
    report.write()
    sections.check_calibration(report, methods)
    report.write()
    sections.start_group(args.device)
    try:
        sections.check_against_torch(report, methods)
    finally:
        sections.stop_group()
    report.write()
    print("\n".join(table(report.rows)))
    if report.budget.left_out:
        print(
            f"\nstopped at the budget ({args.budget:.0f} s); left out: "
            f"{', '.join(report.budget.left_out)}"
        )
    print(f"\nwritten: {out} ({report.budget.elapsed():.0f} s)")
    bad = [r for r in report.rows if r["status"] in ("fail", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
