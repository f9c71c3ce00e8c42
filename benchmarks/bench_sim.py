"""Simulated actions per second of the SimPy engine and of the fast evaluator.

Run from the repository root::

    .venv/bin/python benchmarks/bench_sim.py            # the full sizes (~1 minute)
    .venv/bin/python benchmarks/bench_sim.py --quick    # smaller sizes, for CI

Cases: 1F1B and GPipe with P=8 and M=1,000 micro-batches (N=2 mini-batches), and
asynchronous 1F1B (pipeoptim) with P=64 and N=10,000 mini-batches. Costs are uniform
(F=1, B=2, U=0.1 s per stage, free links), so every action is a timed event.

Set-up (generating the orders, compiling them, drawing durations) is timed apart from the
engines: the planner compiles a method once and evaluates it many times. "SimPy" is
``run_simpy`` (timing only; building a Trace with versions and memory is extra), "fast" is
``list_schedule``; each engine's time is the best of ``--repeat`` runs. Goals: SimPy
>= 100,000 actions/s, fast >= 10x SimPy.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from pipeoptim.plan.methods import get_method
from pipeoptim.sim import CostModel, Program, list_schedule, run_simpy


def bench(name: str, p: int, m: int | None, n: int, repeat: int) -> dict[str, float]:
    method = get_method(name)
    shape = method.shape(p, m, n)
    t0 = time.perf_counter()
    order = method.order(shape)
    t1 = time.perf_counter()
    program = Program(order, shape.micro_batches, method.weight_policy)
    program.steps()  # the cost-independent topological order, cached on the program
    t2 = time.perf_counter()
    costs = CostModel.uniform(shape.num_stages, 1.0, 2.0, 0.1)
    durations = program.durations(costs)
    transfers = program.transfer_times(costs)
    t3 = time.perf_counter()
    simpy_s = fast_s = float("inf")
    for _ in range(repeat):
        a = time.perf_counter()
        simpy_timing = run_simpy(program, durations, transfers)
        simpy_s = min(simpy_s, time.perf_counter() - a)
        a = time.perf_counter()
        fast_timing = list_schedule(program, durations, transfers)
        fast_s = min(fast_s, time.perf_counter() - a)
    if fast_timing.ends != simpy_timing.ends:
        raise SystemExit(f"{name}: the engines disagree; this is a bug")
    return {
        "actions": program.size,
        "order_s": t1 - t0,
        "compile_s": t2 - t1,
        "costs_s": t3 - t2,
        "simpy_s": simpy_s,
        "fast_s": fast_s,
        "simpy_rate": program.size / simpy_s,
        "fast_rate": program.size / fast_s,
        "ratio": simpy_s / fast_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (CI)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per engine (best counts)")
    args = parser.parse_args(argv)
    m, n = (200, 1_000) if args.quick else (1_000, 10_000)
    cases = [("1f1b", 8, m, 2), ("gpipe", 8, m, 2), ("pipeoptim", 64, None, n)]
    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"{'quick' if args.quick else 'full'} sizes"
    )
    header = (
        f"{'case':<28}{'actions':>10}{'order s':>9}{'compile s':>10}"
        f"{'SimPy s':>9}{'SimPy act/s':>13}{'fast s':>9}{'fast act/s':>13}{'fast/SimPy':>11}"
    )
    print(header)
    print("-" * len(header))
    ok = True
    for name, p, mm, nn in cases:
        label = f"{name} P={p} " + (f"M={mm} N={nn}" if mm else f"N={nn}")
        r = bench(name, p, mm, nn, args.repeat)
        print(
            f"{label:<28}{r['actions']:>10,.0f}{r['order_s']:>9.2f}{r['compile_s']:>10.2f}"
            f"{r['simpy_s']:>9.2f}{r['simpy_rate']:>13,.0f}{r['fast_s']:>9.3f}"
            f"{r['fast_rate']:>13,.0f}{r['ratio']:>10.1f}x"
        )
        sys.stdout.flush()
        ok = ok and r["simpy_rate"] >= 100_000 and r["ratio"] >= 10
    print("goals (SimPy >= 100,000 actions/s, fast >= 10x SimPy):", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
