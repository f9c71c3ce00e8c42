"""The simulator runs an overlapped step (OVERLAP_F_B) as the runtime does: its forward and
its backward back to back, so the step costs F + B."""

from __future__ import annotations

from pipeoptim.plan.actions import Action, B, F, U
from pipeoptim.plan.methods import WeightPolicy, get_method
from pipeoptim.sim import CostModel, Program, evaluate_program


def test_an_overlapped_step_costs_the_sum_of_its_actions() -> None:
    order = {
        0: [
            Action(0, F, 0),
            Action(0, F, 1).overlapping(),
            Action(0, B, 0),
            Action(0, B, 1),
            Action(0, U, 0),
        ]
    }
    costs = CostModel.uniform(1, 1.5, 2.5, 0.0)
    result = evaluate_program(Program(order, 2, WeightPolicy.FLUSH), costs)
    assert result.makespan == 1.5 + (1.5 + 2.5) + 2.5


def test_dualpipe_v_costs_as_its_pairs_unmarked() -> None:
    method = get_method("dualpipev")
    shape = method.shape(4, 8, 2)
    order = method.order(shape)
    assert any(a.overlapped for acts in order.values() for a in acts)
    plain = {r: [a.overlapping(False) for a in acts] for r, acts in order.items()}
    costs = CostModel.uniform(shape.num_stages, 1.0, 2.0, 0.5)
    marked = evaluate_program(Program(order, 8, WeightPolicy.FLUSH), costs)
    unmarked = evaluate_program(Program(plain, 8, WeightPolicy.FLUSH), costs)
    assert marked.makespan == unmarked.makespan
    assert marked.rank_busy_s == unmarked.rank_busy_s
