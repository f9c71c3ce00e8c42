"""The planner's predicted peak per stage against the runtime's count, for the plan
``pipeoptim plan --memory-cap`` writes (issue 64, "Show").

Per built-in model: profile it (one batch, one repeat: only the bytes matter here), take the
cap halfway between the smallest possible peak and the least any partition needs without
recomputation (so the planner must recompute), let the planner choose (``plan_for``, what
``pipeoptim plan`` runs), train the plan it chose for a few mini-batches in this process and
read each stage's peak of the runtime's own byte count (weights, copies, optimizer state,
gradients, activations: ``Stage.memory()``). The error is (counted − predicted) / predicted.
Where the search cuts and what it recomputes may move with the measured times; the bytes
of model and count agree for every choice (docs/fitting-in-memory.md).

    python benchmarks/bench_plan_memory.py                       # cnn, mlp, gpt; 1f1b, P = 2
    python benchmarks/bench_plan_memory.py --models mlp --method pipeoptim --stages 3
    python benchmarks/bench_plan_memory.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

BATCH, STEPS = 32, 4


@dataclass(frozen=True)
class StageBytes:
    model: str
    stage: int
    layers: tuple[int, int]
    recomputed: tuple[int, ...]
    predicted: int
    counted: int

    @property
    def error(self) -> float:
        return (self.counted - self.predicted) / self.predicted


def plan_and_count(
    model: str, method: str = "1f1b", stages: int = 2, steps: int = STEPS, batch: int = BATCH
) -> tuple[int, list[StageBytes]]:
    """The cap, and per stage of the plan the planner writes under it: its predicted peak
    and the runtime's counted peak over ``steps`` mini-batches."""
    from pipeoptim.plan.memory_factors import method_memory_factors
    from pipeoptim.plan.methods import get_method
    from pipeoptim.plan.partition import min_memory_partition
    from pipeoptim.planning import PlanLimits, per_unit_profile, plan_for
    from pipeoptim.planning.memory_fit import smallest_reach
    from pipeoptim.runtime.pipeline import Pipeline
    from pipeoptim.workloads.loader import build_model, model_loss
    from pipeoptim.workloads.profiling import profile_builtin

    spec = get_method(method)
    # M = 2P: the steady state holds a stage's gradients with its activations in flight
    m = 2 * stages if spec.micro_batched_by_default else 1
    profile = profile_builtin(model, batch_size=batch, repeats=1)
    unit = per_unit_profile(profile, m)
    reach = smallest_reach(unit, spec, stages, m, 1)
    factors = method_memory_factors(method, stages, m)
    plain = min_memory_partition(unit, stages, memory_factors=factors).peak_memory_bytes
    cap = (reach + plain) // 2  # below any partition without recomputation
    limits = PlanLimits(memory_cap_bytes=cap, micro_batches=m)
    choice = plan_for(profile, stages=stages, method=method, limits=limits, model=model)
    assert choice.best.partition is not None
    predicted = choice.best.partition.stage_memory

    layers, data = build_model(model, 0)
    pipe = Pipeline(layers, plan=choice.plan, loss_fn=model_loss(model), memory_every=1)
    x, y = data.train_x, data.train_y
    # own storage per batch, as a data loader hands them (a saved view counts its span)
    batches = [
        (x[i * batch : (i + 1) * batch].clone(), y[i * batch : (i + 1) * batch].clone())
        for i in range(steps)
    ]
    pipe.fit(batches, epochs=1)
    counted: dict[int, int] = {}
    for m in pipe.recorder.memory:
        # by kind (the sample also carries each stage's total, "stage:K")
        held = sum(v for kind, v in m.detail.items() if not kind.startswith("stage:"))
        counted[m.rank] = max(counted.get(m.rank, 0), held)
    sets = choice.best.partition.recompute or [frozenset()] * stages
    rows = [
        StageBytes(
            model,
            k,
            choice.best.partition.boundaries[k],
            tuple(sorted(sets[k])),
            int(predicted[k]),
            counted[k],
        )
        for k in range(stages)
    ]
    return cap, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,mlp,gpt", help="comma-separated built-ins")
    parser.add_argument("--method", default="1f1b")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out: list[dict[str, Any]] = []
    for model in args.models.split(","):
        cap, rows = plan_and_count(model, args.method, args.stages, args.steps)
        out += [{**r.__dict__, "cap": cap, "error": r.error} for r in rows]
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    print(f"{args.method}, P = {args.stages}, batch {BATCH}, {args.steps} mini-batches")
    print("| model | cap (B) | stage | layers | recomputed | predicted (B) | counted (B) | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        start, end = r["layers"]
        units = ",".join(map(str, r["recomputed"])) or "-"
        print(
            f"| {r['model']} | {r['cap']:,} | {r['stage']} | {start}..{end - 1} | {units} "
            f"| {r['predicted']:,} | {r['counted']:,} | {100 * r['error']:+.1f} % |"
        )


if __name__ == "__main__":
    main()
