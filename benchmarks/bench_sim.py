"""Simulated actions per second of the SimPy engine and of the fast evaluator.

Run from the repository root::

    .venv/bin/python benchmarks/bench_sim.py            # the full sizes (~1 minute)
    .venv/bin/python benchmarks/bench_sim.py --quick    # smaller sizes, for CI

Cases: 1F1B and GPipe with P=8 and M=1,000 micro-batches (N=2 mini-batches), and
asynchronous 1F1B (pipeoptim) with P=64 and N=10,000 mini-batches. Costs are uniform
(F=1, B=2, U=0.1 s per stage, free links), so every action is a timed event.

Set-up (generating the orders in array form, compiling them with their topological
order) is timed apart from the engines: the planner compiles a method once and evaluates it
many times. "SimPy" is ``run_simpy`` (timing only; building a Trace with versions and
memory is extra), "fast" is ``evaluate_program`` as the planner calls it (bubbles and
throughput); "+timing s" is the same call keeping every action's start and end in action
order, the output SimPy gives. Both engines' times include drawing the durations from the
costs; each is the best of ``--repeat`` runs, and the timings of SimPy, of
``evaluate_program`` and of ``list_schedule`` must agree to the bit. "whole" is a new
evaluation as a user meets it: order + compile + the first evaluate, best of ``--repeat``;
"cold" is the first of them, which also pays for the process's first touch of the memory
(about 1 ms per MB on this virtual machine). "versions" is the weight-version analysis of
the same order, best of ``--repeat``.

Goals: SimPy >= 100,000 actions/s; fast >= 10x SimPy on every case; for pipeoptim at
P=64, N=10,000 the whole evaluation <= 0.5 s and the version analysis < 0.5 s.

A last line times both engines where ranks share cores (pipeoptim, 8 ranks on a host of 4
cores, processor sharing, messages with a fixed cost): the event-driven evaluator is no
list schedule, so it is slower, and both engines must still agree to the bit.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import replace

from pipeoptim.plan.machine import Machine
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.versions import analyze_order
from pipeoptim.sim import CostModel, Program, evaluate_program, list_schedule, run_simpy
from pipeoptim.sim.evaluate import schedule


def bench(name: str, p: int, m: int | None, n: int, repeat: int) -> dict[str, float]:
    method = get_method(name)
    shape = method.shape(p, m, n)
    costs = CostModel.uniform(shape.num_stages, 1.0, 2.0, 0.1)
    cold = order_s = compile_s = whole_s = versions_s = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        order = method.order_arrays(shape)
        t1 = time.perf_counter()
        program = Program(order, shape.micro_batches, method.weight_policy)
        program.steps()  # the cost-independent topological order, cached on the program
        t2 = time.perf_counter()
        evaluate_program(program, costs)
        t3 = time.perf_counter()
        analyze_order(order, method.weight_policy, shape.micro_batches)
        t4 = time.perf_counter()
        cold = min(cold, t3 - t0) if cold == float("inf") else cold
        order_s, compile_s = min(order_s, t1 - t0), min(compile_s, t2 - t1)
        whole_s, versions_s = min(whole_s, t3 - t0), min(versions_s, t4 - t3)
    simpy_s = fast_s = timing_s = float("inf")
    for _ in range(repeat):
        a = time.perf_counter()
        simpy_timing = run_simpy(program, program.durations(costs), program.transfer_times(costs))
        simpy_s = min(simpy_s, time.perf_counter() - a)
        a = time.perf_counter()
        evaluate_program(program, costs)
        fast_s = min(fast_s, time.perf_counter() - a)
        a = time.perf_counter()
        fast_timing = evaluate_program(program, costs, keep_timing=True).timing
        timing_s = min(timing_s, time.perf_counter() - a)
    listed = list_schedule(program, program.durations(costs), program.transfer_times(costs))
    if fast_timing is None or not fast_timing.ends == listed.ends == simpy_timing.ends:
        raise SystemExit(f"{name}: the engines disagree; this is a bug")
    return {
        "actions": program.size,
        "order_s": order_s,
        "compile_s": compile_s,
        "whole_s": whole_s,
        "cold_s": cold,
        "versions_s": versions_s,
        "simpy_s": simpy_s,
        "fast_s": fast_s,
        "timing_s": timing_s,
        "simpy_rate": program.size / simpy_s,
        "fast_rate": program.size / fast_s,
        "ratio": simpy_s / fast_s,
    }


def bench_shared(p: int, n: int, cores: int, repeat: int) -> dict[str, float]:
    """Both engines on pipeoptim with ``p`` ranks sharing ``cores`` cores."""
    method = get_method("pipeoptim")
    shape = method.shape(p, None, n)
    costs = replace(
        CostModel.uniform(p, 1.0, 2.0, 0.1),
        machine=Machine(cores, ranks_per_host=p),
        message_send_s=0.05,
        message_receive_s=0.02,
    )
    program = Program(method.order_arrays(shape), shape.micro_batches, method.weight_policy)
    durations, transfers = program.durations(costs), program.transfer_times(costs)
    simpy_s = fast_s = float("inf")
    for _ in range(repeat):
        a = time.perf_counter()
        engine = run_simpy(program, durations, transfers, machine=costs.machine)
        simpy_s = min(simpy_s, time.perf_counter() - a)
        a = time.perf_counter()
        fast = schedule(program, durations, transfers, costs)
        fast_s = min(fast_s, time.perf_counter() - a)
    if engine.ends != fast.ends or engine.starts != fast.starts:
        raise SystemExit("shared cores: the engines disagree; this is a bug")
    return {"actions": program.size, "simpy_rate": program.size / simpy_s,
            "fast_rate": program.size / fast_s}  # fmt: skip


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
        f"{'case':<24}{'actions':>10}{'order s':>9}{'compile s':>10}{'whole s':>9}{'cold s':>8}"
        f"{'versions s':>11}{'SimPy act/s':>13}{'fast act/s':>13}{'fast/SimPy':>11}"
        f"{'+timing s':>10}"
    )
    print(header)
    print("-" * len(header))
    engines_ok = True
    last: dict[str, float] = {}
    for name, p, mm, nn in cases:
        label = f"{name} P={p} " + (f"M={mm} N={nn}" if mm else f"N={nn}")
        r = last = bench(name, p, mm, nn, args.repeat)
        print(
            f"{label:<24}{r['actions']:>10,.0f}{r['order_s']:>9.2f}{r['compile_s']:>10.2f}"
            f"{r['whole_s']:>9.2f}{r['cold_s']:>8.2f}{r['versions_s']:>11.2f}{r['simpy_rate']:>13,.0f}"
            f"{r['fast_rate']:>13,.0f}{r['ratio']:>10.1f}x{r['timing_s']:>10.3f}"
        )
        sys.stdout.flush()
        engines_ok = engines_ok and r["simpy_rate"] >= 100_000 and r["ratio"] >= 10
    print("goal SimPy >= 100,000 actions/s and fast >= 10x SimPy:", _met(engines_ok))
    shared_n = 200 if args.quick else 2_000
    r = bench_shared(8, shared_n, 4, args.repeat)
    print(
        f"shared cores, pipeoptim P=8 N={shared_n:,} on 4 cores: {r['actions']:,.0f} actions, "
        f"SimPy {r['simpy_rate']:,.0f} actions/s, fast {r['fast_rate']:,.0f} actions/s, "
        f"equal to the bit"
    )
    if not args.quick:
        print(f"goal whole evaluation <= 0.5 s at P=64 N=10,000: {_met(last['whole_s'] <= 0.5)}")
        print(f"goal version analysis < 0.5 s at P=64 N=10,000: {_met(last['versions_s'] < 0.5)}")
    return 0


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    sys.exit(main())
