"""The simulated bubble of DualPipeV, interleaved zero bubble and ZB-V against the published
formulas, at P = 4, 8, 16 ranks.

Run from the repository root::

    .venv/bin/python benchmarks/bench_bubble.py

Unit costs per stage (a stage is half a rank's layers for these two-stages-per-rank
methods): F = 1, B = 2, split as I = W = 1, updates free, links free. The simulator runs an
overlapped step (OVERLAP_F_B) as the runtime does, its two actions back to back, so
F&B = F + B = 3. The bubble is each rank's idle time over one mini-batch (the span from the
first action to the last, less the rank's compute), the same on every rank here; M = 2P and
4P micro-batches give the same bubble (printed once).

Formulas, from the DeepSeek-V3 report's table (F, B, W and F&B per stage):

* DualPipe on N ranks: (N/2 - 1)(F&B + B - 3W); DualPipeV folds it onto half the ranks, so
  on P ranks it is DualPipe's with N = 2P: (P - 1)(F&B + B - 3W);
* ZB1P, the zero-bubble paper's 1F1B with W's filling bubbles, the claim interleaved zero
  bubble and ZB-V are measured against: (P - 1)(F + B - 2W);
* 1F1B (interleaved, per stage): (P - 1)(F + B), the baseline.
"""

from __future__ import annotations

from typing import NamedTuple

from pipeoptim.plan.methods import get_method
from pipeoptim.sim import CostModel, Program, evaluate_program

F, B, W = 1.0, 2.0, 1.0
F_AND_B = F + B  # back to back, as the runtime and the simulator run an overlapped step
SIZES = (4, 8, 16)


class Row(NamedTuple):
    method: str
    ranks: int
    simulated: float
    """Idle seconds of the idlest rank over one mini-batch, the same at M = 2P and 4P."""
    formula: float
    formula_text: str
    activations: int
    """Stage-sized activations the busiest rank holds (the memory model's slots of its two
    stages); DualPipe's claim for comparison is P+1 micro-batches of a rank's layers."""


FORMULAS = {
    "dualpipev": ("(P-1)(F&B+B-3W)", lambda p: (p - 1) * (F_AND_B + B - 3 * W)),
    "interleaved-zb": ("(P-1)(F+B-2W)", lambda p: (p - 1) * (F + B - 2 * W)),
    "zb-v": ("(P-1)(F+B-2W)", lambda p: (p - 1) * (F + B - 2 * W)),
    "interleaved-1f1b": ("(P-1)(F+B)", lambda p: (p - 1) * (F + B)),
}


def simulated_bubble(method: str, ranks: int, micro_batches: int) -> float:
    """The largest per-rank idle time over one mini-batch at the unit costs."""
    spec = get_method(method)
    shape = spec.shape(ranks, micro_batches, 1)
    program = Program(spec.order(shape), micro_batches, spec.weight_policy)
    costs = CostModel.uniform(shape.num_stages, F, B, 0.0, weight_grad_fraction=W / B)
    result = evaluate_program(program, costs)
    return max(result.span - busy for busy in result.rank_busy_s.values())


def rows() -> list[Row]:
    out = []
    for p in SIZES:
        for method, (text, formula) in FORMULAS.items():
            bubbles = {simulated_bubble(method, p, m) for m in (2 * p, 4 * p)}
            if len(bubbles) != 1:
                raise RuntimeError(f"{method} at P={p}: the bubble moves with M: {bubbles}")
            spec = get_method(method)
            slots = [spec.activation_slots(k, 2 * p, 2 * p) for k in range(2 * p)]
            stages_of = [
                (r, 2 * p - 1 - r) if spec.folds_stages_in_a_v else (r, r + p) for r in range(p)
            ]
            held = max(slots[a] + slots[b] for a, b in stages_of)
            out.append(Row(method, p, bubbles.pop(), formula(p), text, held))
    return out


def table(found: list[Row]) -> str:
    lines = [
        f"unit costs per stage: F = {F:g}, B = {B:g} (I = W = {W:g}), F&B = F + B = "
        f"{F_AND_B:g}; bubble = idle time per rank and mini-batch",
        "| P | method | simulated bubble | published formula | formula's value | activations "
        "per rank (stage-sized) |",
        "|---|---|---|---|---|---|",
    ]
    for row in found:
        lines.append(
            f"| {row.ranks} | {row.method} | {row.simulated:g} | {row.formula_text} | "
            f"{row.formula:g} | {row.activations} |"
        )
    return "\n".join(lines)


def main() -> None:
    print(table(rows()))


if __name__ == "__main__":
    main()
