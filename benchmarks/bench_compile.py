"""What ``compile=True`` (inductor) saves per training step of the gpt workload, against eager.

Run from the repository root::

    .venv/bin/python benchmarks/bench_compile.py [--method 1f1b] [--steps 6] [--rounds 2]

Why: ``Pipeline(compile=...)`` compiles each unit once at stage build (``stage/compiled.py``);
what that buys depends on the model and the machine. The script trains the ``gpt`` workload
(embedding, 6 blocks, final norm, head; context 64, batch 32) in one process (``transport=
"local"``) on 2 stages, eager and compiled, each on its own Pipeline built from the same
seed. Each Pipeline first trains ``--warmup`` mini-batches (the compiled one compiles there,
and the time that took is printed), then ``--steps`` timed ones; the two are timed in
alternation, ``--rounds`` times, and the median seconds per step of each and their ratio are
printed, so a machine whose load changes over the run weighs on both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.workloads.gpt import CONTEXT, VOCAB_SIZE, gpt, lm_loss

BATCH = 32


def batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` mini-batches of random characters (the step's cost does not depend on them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB_SIZE, (BATCH, CONTEXT + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def build(method: str, compile: bool | str) -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(
        gpt(),
        method=method,
        stages=2,
        loss_fn=lm_loss,
        optimizer=OptimizerSpec("adamw", 2e-3),
        compile=compile,
        log_every=1000,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="1f1b")
    parser.add_argument("--compile", default="inductor", help="the compile option timed")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    pipes = {"eager": build(args.method, False), "compiled": build(args.method, args.compile)}
    for name, pipe in pipes.items():
        start = time.perf_counter()
        pipe.fit(batches(args.warmup, 1), epochs=1)
        print(f"{name}: warm-up of {args.warmup} steps {time.perf_counter() - start:.1f} s")
    per_step: dict[str, list[float]] = {name: [] for name in pipes}
    losses: dict[str, list[float]] = {name: [] for name in pipes}
    for r in range(args.rounds):
        for name, pipe in pipes.items():
            data = batches(args.steps, 100 + r)  # the same batches for both
            start = time.perf_counter()
            result = pipe.fit(data, epochs=1)
            per_step[name].append((time.perf_counter() - start) / args.steps)
            losses[name] += result.losses
    eager, compiled = (statistics.median(per_step[n]) for n in ("eager", "compiled"))
    drift = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"], strict=True))
    print(
        f"# gpt, {args.method}, 2 stages, local, batch {BATCH}, {torch.get_num_threads()} "
        f"threads, median of {args.rounds} rounds of {args.steps} steps"
    )
    print("| run | ms per step |")
    print("|---|---|")
    print(f"| eager | {1e3 * eager:.1f} |")
    print(f"| compile={args.compile!r} | {1e3 * compiled:.1f} |")
    print(f"compiled / eager: {compiled / eager:.2f}x; largest loss difference {drift:.2e}")


if __name__ == "__main__":
    main()
