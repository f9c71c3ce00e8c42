"""The array path: orders generated as arrays, compiled without Action objects, evaluated in
a topological order by unit-time levels; every result equal to the Action path's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from support.sim_costs import unequal_costs as _costs

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import Action, B, F, Schedule, U
from pipeoptim.plan.methods import METHODS, WeightPolicy, get_method
from pipeoptim.plan.orders import OrderArrays
from pipeoptim.plan.zero_bubble import zb_h1, zb_v
from pipeoptim.sim import CostModel, Program, evaluate_program, list_schedule, run_simpy
from pipeoptim.sim.evaluate import summarize
from pipeoptim.sim.steps import flat_buffer, levels


def _shapes(name: str) -> list:
    method = get_method(name)
    out = []
    for p, m, n in [(1, 1, 2), (2, 2, 3), (4, 4, 5), (3, 6, 2)]:
        if method.interleaved and m % p:
            continue
        out.append(method.shape(p, m if method.micro_batched else None, n))
    return out


CASES = [(name, shape) for name in METHODS for shape in _shapes(name)]


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_array_order_compiles_like_the_action_order(name: str, shape) -> None:
    method = get_method(name)
    arrays = method.order_arrays(shape)
    assert arrays.to_order() == {r: list(a) for r, a in method.order(shape).items()}
    a = Program(arrays, shape.micro_batches, method.weight_policy)
    b = Program(method.order(shape), shape.micro_batches, method.weight_policy)
    assert (a.stage, a.kind, a.mb, a.dep, a.edge) == (b.stage, b.kind, b.mb, b.dep, b.edge)
    assert a.stage_rank == b.stage_rank
    assert a.flat_versions() == b.flat_versions()


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_steps_are_a_topological_order(name: str, shape) -> None:
    method = get_method(name)
    program = Program(method.order_arrays(shape), shape.micro_batches, method.weight_policy)
    steps = program.steps()
    order = steps.order_array.tolist()
    assert sorted(order) == list(range(program.size))
    for j, i in enumerate(order):
        lo = next(lo for lo, hi in program.rank_bounds if lo <= i < hi)
        assert steps.previous[j] == (0 if i == lo else steps.position_array[i - 1] + 1)
        assert steps.previous[j] <= j and steps.input[j] <= j  # slots: step + 1, 0 none
        d = program.dep[i]
        assert steps.input[j] == (0 if d < 0 else steps.position_array[d] + 1)


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_every_evaluation_path_gives_simpys_times(name: str, shape) -> None:
    method = get_method(name)
    program = Program(method.order_arrays(shape), shape.micro_batches, method.weight_policy)
    _check_every_path(program, _costs(shape.num_stages))


ZERO_BUBBLE = [
    ("zb-h1", zb_h1, 1, 1, 2),
    ("zb-h1", zb_h1, 2, 2, 3),
    ("zb-h1", zb_h1, 4, 4, 2),
    ("zb-h1", zb_h1, 3, 7, 2),
    ("zb-v", zb_v, 2, 1, 2),
    ("zb-v", zb_v, 4, 3, 2),
    ("zb-v", zb_v, 6, 5, 3),
    ("zb-v", zb_v, 8, 7, 2),
]


@pytest.mark.parametrize(
    ("name", "generate", "stages", "micro", "mini"),
    ZERO_BUBBLE,
    ids=[f"{c[0]}-S{c[2]}-M{c[3]}-N{c[4]}" for c in ZERO_BUBBLE],
)
def test_split_backward_schedules_give_simpys_times(
    name: str, generate: Callable[[int, int, int], Schedule], stages: int, micro: int, mini: int
) -> None:
    """Schedules with I and W (zero bubble) run alike on every path, I != W in cost."""
    schedule = generate(stages, micro, mini)
    program = Program(schedule, micro, WeightPolicy.FLUSH)
    assert program.arrays.to_order() == {
        r: [a for a in row if a is not None] for r, row in schedule.items()
    }  # I and W survive the array form
    assert Program(OrderArrays.from_order(schedule), micro).dep == program.dep
    costs = dataclasses.replace(_costs(stages), weight_grad_fraction=0.4)
    _check_every_path(program, costs)


def _check_every_path(program: Program, costs: CostModel) -> None:
    durations, transfers = program.durations(costs), program.transfer_times(costs)
    simpy = run_simpy(program, durations, transfers, contention=False)
    listed = list_schedule(program, durations, transfers)
    fast = evaluate_program(program, costs, keep_timing=True)
    assert fast.timing is not None
    assert simpy.starts == listed.starts == fast.timing.starts
    assert simpy.ends == listed.ends == fast.timing.ends
    # busy time from per-code counts equals the sum over the actions' durations
    reference = summarize(program, costs, simpy, durations)
    assert fast.busy_s == pytest.approx(reference.busy_s)
    assert fast.rank_busy_s == pytest.approx(reference.rank_busy_s)
    assert fast.steady_throughput == pytest.approx(reference.steady_throughput)
    assert fast.overall_bubble == pytest.approx(reference.overall_bubble)
    # a forward that writes a prediction costs its forward plus the prediction; one on the
    # Ŵ its stage already wrote since its last update costs a forward; an update a write
    # follows costs the update plus the kept Δ
    predicted = program.prediction_writes().tolist()
    setups = program.prediction_setups().tolist()
    for i in range(program.size):
        k, kind = program.stage[i], program.kind[i]
        plain = (
            costs.forward_s,
            costs.backward_s,
            costs.update_s,
            costs.backward_input_s,
            costs.backward_weight_s,
        )[kind][k]
        if predicted[i]:
            assert durations[i] == plain + costs.predict_s[k]
        elif setups[i]:
            assert durations[i] == plain + costs.prediction_setup_s[k]
        else:
            assert durations[i] == plain


def test_flat_buffer_keeps_every_value_in_the_narrowest_form() -> None:
    small, medium = np.array([0, 7, 255]), np.array([0, 256, 65535])
    large, negative = np.array([1, 1 << 40]), np.array([-1, 3])
    assert flat_buffer(small) == bytes([0, 7, 255])
    assert list(flat_buffer(medium)) == [0, 256, 65535]
    assert getattr(flat_buffer(medium), "typecode", None) == "H"
    assert list(flat_buffer(large)) == [1, 1 << 40]
    assert list(flat_buffer(negative)) == [-1, 3]
    assert flat_buffer(np.zeros(0, dtype=np.int64)) == b""


def test_cost_codes_past_a_byte_give_simpys_times() -> None:
    # 48 stages with predictions: the predicted forwards' duration codes run to 6 * 48
    method = get_method("pipeoptim")
    shape = method.shape(48, None, 3)
    program = Program(method.order_arrays(shape), 1, method.weight_policy)
    costs = _costs(48)
    assert max(program.step_cost_codes(costs)) >= 1 << 8
    _check_every_path(program, costs)


def test_jittered_evaluation_equals_simpy() -> None:
    method = get_method("pipeoptim")
    shape = method.shape(3, None, 6)
    program = Program(method.order_arrays(shape), 1, method.weight_policy)
    costs = _costs(3)
    simpy = run_simpy(program, program.durations(costs, 0.3, 5), program.transfer_times(costs))
    fast = evaluate_program(program, costs, jitter=0.3, seed=5, keep_timing=True)
    assert fast.timing is not None and fast.timing.ends == simpy.ends


def test_compile_errors_name_the_action() -> None:
    split = {0: [Action(0, F, 0), Action(1, F, 0)], 1: [Action(1, B, 0), Action(0, B, 0)]}
    with pytest.raises(ScheduleError, match=r"stage 1 has actions on rank 0 and rank 1.*1B0"):
        Program(split)
    twice = {0: [Action(0, F, 0), Action(0, B, 0), Action(0, F, 0)]}
    with pytest.raises(ScheduleError, match=r"0F0 appears twice in the order \(also as action 0\)"):
        Program(twice)
    update_first = {0: [Action(0, F, 0), Action(0, U, 0), Action(0, B, 0)]}
    with pytest.raises(ScheduleError, match="rank 0 runs 0U0 before 0B0"):
        Program(update_first)
    assert Program(OrderArrays.from_order({})).size == 0


def test_a_deadlocked_order_falls_back_to_the_worklist_and_names_the_waits() -> None:
    order = {
        0: [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        1: [Action(1, F, 1), Action(1, B, 1), Action(1, F, 0), Action(1, B, 0)],
    }
    program = Program(order)
    inputs = np.where(program.dep_array >= 0, program.dep_array, program.size)
    assert levels(inputs, program.rank_bounds) is None  # the sweeps never settle on a cycle
    with pytest.raises(ScheduleError, match="rank 0 waits at 0B0 for 1B0"):
        program.steps()


@pytest.mark.parametrize("spread", [1, 10**9])  # a dense table, then binary search
def test_key_index_finds_keys_and_names_the_first_repeat(spread: int) -> None:
    from pipeoptim.plan.orders import KeyIndex

    keys = np.array([5, 3, 9, 3, 5, 7], dtype=np.int64) * spread
    index = KeyIndex(keys)
    found = index.find(np.array([9, 7, 4], dtype=np.int64) * spread)
    assert found.tolist() == [2, 5, -1]
    assert index.duplicate() == (3, 1)  # entry 3 repeats entry 1's key, before 4 repeats 0
    assert KeyIndex(np.array([2, 0, 1], dtype=np.int64) * spread).duplicate() is None
    assert KeyIndex(np.zeros(0, dtype=np.int64)).find(np.array([1])).tolist() == [-1]


def test_the_update_a_prediction_follows_pays_the_kept_delta_once() -> None:
    """PipeOptim on 2 stages, 1 micro-batch, 4 mini-batches: stage 0 predicts (s = 1) on
    F1..F3; F1 reads the initial weights (no update before it: no Δ to compute), F2 and
    F3 follow U0 and U1, which pay update + setup, and each predicted forward pays
    forward + write; U2, U3 (no forward after them) and stage 1 (s = 0) pay neither."""
    method = get_method("pipeoptim")
    shape = method.shape(2, 1, 4)
    program = Program(method.order(shape), shape.micro_batches, method.weight_policy)
    costs = CostModel.uniform(2, 1.0, 2.0, 0.5, predict_s=0.25, prediction_setup_s=0.125)
    names = [program.describe(i) for i in range(program.size)]
    got = dict(zip(names, program.durations(costs), strict=True))
    assert got == {
        **{"0F0": 1.0, "0F1": 1.25, "0F2": 1.25, "0F3": 1.25},
        **{"0U0": 0.625, "0U1": 0.625, "0U2": 0.5, "0U3": 0.5},
        **{f"0B{mb}": 2.0 for mb in range(4)},
        **{f"1{k}{mb}": t for k, t in (("F", 1.0), ("B", 2.0), ("U", 0.5)) for mb in range(4)},
    }
    _check_every_path(program, costs)
