"""The validator: every rule, with errors that name rank, step and action and show the grid."""

from __future__ import annotations

import itertools

import pytest

from pipeoptim.errors import ScheduleError
from pipeoptim.plan import build_schedule
from pipeoptim.plan.actions import Action, Kind, compact, schedule_from_csv
from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.plan.orders import OrderArrays
from pipeoptim.plan.passes import (
    add_communication,
    merge_backward,
    split_backward,
    strip_communication,
)
from pipeoptim.plan.schedules import Order, retime
from pipeoptim.plan.validate import validate
from pipeoptim.plan.versions import analyze_versions


def check(csv_text: str, message: str) -> str:
    with pytest.raises(ScheduleError, match=message) as err:
        validate(schedule_from_csv(csv_text))
    return str(err.value)


def test_missing_backward_is_named_with_its_position() -> None:
    text = check("0F0,0F1,,0B0\n,1F0,1B0,1F1,1B1\n", r"rank 0, step 1: 0F1 has no backward")
    assert "[0F1]" in text  # the grid marks the offending cell


def test_cross_stage_dependency_violation() -> None:
    text = check("0F0,0B0\n,1F0,1B0\n", r"0B0 runs at step 1 but needs 1B0, which runs at step 2")
    assert "[0B0]" in text


def test_forward_after_previous_stage() -> None:
    check("0F0,,0B0\n1F0,1B0\n", r"1F0 runs at step 0 but needs 0F0")


def test_duplicate_action() -> None:
    check("0F0,0F0,0B0\n,1F0,1B0\n", r"0F0 appears twice \(first at rank 0, step 0\)")


def test_stage_split_over_ranks() -> None:
    check("0F0,,,0B0\n,1F0,1B0,\n,,,0F1\n", "rank 0 also runs stage 0")


def test_backward_before_forward() -> None:
    check("0B0,0F0\n", "0B0 runs before its forward 0F0")


def test_update_before_its_backwards() -> None:
    check("0F0,0U0,0B0\n", "0U0 runs before 0B0")


def test_missing_micro_batch_on_a_stage() -> None:
    check("0F0,0F1,,0B0,,0B1\n,1F0,1B0\n", "micro-batch 1 never runs on stage 1")


def test_deadlock() -> None:
    text = check("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "deadlocks")
    assert "rank 0 waits at 0B0 for 1B0" in text


def test_empty() -> None:
    with pytest.raises(ScheduleError, match="empty"):
        validate({0: [None, None]})


def test_communication_lowering_is_pure_and_reversible() -> None:
    schedule, _ = build_schedule("pipeoptim", 3, None, 3)
    lowered = add_communication(schedule)
    assert [str(a) for a in lowered[2][:5]] == ["2RECV_F0", "2F0", "2B0", "2SEND_B0", "2U0"]
    assert [str(a) for a in lowered[0][:4]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1"]
    compute = {r: [a for a in row if a is not None] for r, row in schedule.items()}
    assert strip_communication(lowered) == compute
    # every send has its matching receive on the neighbouring stage
    sends = {(a.kind.value, a.stage, a.mb) for row in lowered.values() for a in row}
    for kind, stage, mb in sends:
        if kind == "SEND_F":
            assert ("RECV_F", stage + 1, mb) in sends
        if kind == "SEND_B":
            assert ("RECV_B", stage - 1, mb) in sends


# --- split backward: I (input gradient) then W (weight gradient), zero-bubble schedules ---

SPLIT_SHAPES = [
    ("gpipe", 3, 2, 2, None),
    ("1f1b", 4, 4, 2, None),
    ("gpipe", 2, 1, 3, None),
    ("interleaved-1f1b", 2, 4, 2, 2),
    ("interleaved-1f1b", 4, 8, 1, 2),
    ("pipedream", 3, None, 4, None),
    ("2bw", 3, 3, 3, None),
    ("pipeoptim", 4, None, 6, None),
]


def split_order(method: str, p: int, m: int | None, n: int, v: int | None) -> tuple[Order, int]:
    schedule, shape = build_schedule(method, p, m, n, v)
    return split_backward(schedule), shape.micro_batches


def defer_weights(order: Order) -> Order:
    """Zero-bubble style: every W waits until just before its stage's next update (or the
    end of the rank), the latest a W may run."""
    out: Order = {}
    for rank, acts in order.items():
        row: list[Action] = []
        held: list[Action] = []
        for a in acts:
            if a.kind is Kind.BACKWARD_WEIGHT:
                held.append(a)
                continue
            if a.kind is Kind.UPDATE:
                row += [w for w in held if w.stage == a.stage]
                held = [w for w in held if w.stage != a.stage]
            row.append(a)
        out[rank] = row + held
    return out


def test_split_counts_follow_the_rule_not_a_table() -> None:
    order, m = split_order("1f1b", 3, 3, 2, None)
    kinds = [a.kind for acts in order.values() for a in acts]
    assert Kind.BACKWARD not in kinds
    assert kinds.count(Kind.BACKWARD_INPUT) == kinds.count(Kind.BACKWARD_WEIGHT) == 3 * m * 2
    for acts in order.values():  # each W right after its own I
        for a, b in itertools.pairwise(acts):
            if a.kind is Kind.BACKWARD_INPUT:
                assert b == Action(a.stage, Kind.BACKWARD_WEIGHT, a.mb)


@pytest.mark.parametrize(("method", "p", "m", "n", "v"), SPLIT_SHAPES)
def test_split_and_deferred_weight_schedules_validate(
    method: str, p: int, m: int | None, n: int, v: int | None
) -> None:
    order, micro = split_order(method, p, m, n, v)
    for variant in (order, defer_weights(order)):
        grid = retime(variant, micro)
        assert validate(grid) == micro
        assert validate(add_communication(grid), micro) == micro  # the lowered order too
        assert compact(retime(merge_backward(grid), micro)) == compact(
            build_schedule(method, p, m, n, v)[0]
        )


@pytest.mark.parametrize(("method", "p", "m", "n", "v"), SPLIT_SHAPES)
def test_broken_split_schedules_fail_with_the_rule(
    method: str, p: int, m: int | None, n: int, v: int | None
) -> None:
    order, micro = split_order(method, p, m, n, v)
    grid = retime(order, micro)
    where = {a: (r, s) for r, acts in grid.items() for s, a in enumerate(acts) if a is not None}

    # W before its own I: swap the first I of the last rank with its W
    rank = max(grid)
    row = list(grid[rank])
    inp = next(a for a in row if a is not None and a.kind is Kind.BACKWARD_INPUT)
    wgt = Action(inp.stage, Kind.BACKWARD_WEIGHT, inp.mb)
    at, later = where[inp][1], where[wgt][1]
    row[at], row[later] = wgt, inp
    with pytest.raises(ScheduleError, match=rf"rank {rank}, step {at}: {wgt} runs before {inp}"):
        validate({**grid, rank: row})

    # an update before a W of its mini-batch: the first update moves before its stage's last W
    r, acts = 0, grid[0]
    u = next(i for i, a in enumerate(acts) if a is not None and a.kind is Kind.UPDATE)
    update = acts[u]
    assert update is not None
    last_w = max(
        i
        for i, a in enumerate(acts[:u])
        if a is not None and a.kind is Kind.BACKWARD_WEIGHT and a.stage == update.stage
    )
    row = list(acts)
    row.insert(last_w, row.pop(u))
    with pytest.raises(
        ScheduleError, match=rf"rank {r}, step {last_w}: {update} runs before {acts[last_w]}"
    ):
        validate({**grid, r: row})

    # an I placed in the column of the next stage's I it needs (same order, one column early)
    moved = 0
    for a, (r, s) in where.items():
        dep = Action(a.stage + 1, Kind.BACKWARD_INPUT, a.mb)
        if a.kind is not Kind.BACKWARD_INPUT or dep not in where:
            continue
        s_dep = where[dep][1]
        if s_dep < s and all(c is None for c in grid[r][s_dep:s]):
            row = list(grid[r])
            row[s_dep], row[s] = a, None
            with pytest.raises(
                ScheduleError,
                match=rf"rank {r}, step {s_dep}: {a} runs at step {s_dep} but needs {dep}",
            ):
                validate({**grid, r: row})
            moved += 1
    assert moved > 0


def test_hand_written_split_schedules() -> None:
    # stage 1 splits, stage 0 runs full backwards: both forms may mix across stages
    assert validate(schedule_from_csv("0F0,0F1,,0B0,,0B1,0U0\n,1F0,1I0,1F1,1I1,1W0,1W1,1U0\n")) == 2
    assert validate(schedule_from_csv("0F0,,,0I0,0W0\n,1F0,1I0,,1W0\n")) == 1


@pytest.mark.parametrize(
    ("csv_text", "message"),
    [
        ("0F0,0W0,0I0\n", r"rank 0, step 1: 0W0 runs before 0I0: the weight gradient"),
        ("0F0,0I0,0U0,0W0\n", r"rank 0, step 2: 0U0 runs before 0W0, whose gradient it applies"),
        ("0F0,,0I0,0W0\n,1F0,1I0,1W0\n", r"rank 0, step 2: 0I0 runs at step 2 but needs 1I0"),
        ("0F0,0B0,0I0,0W0\n", r"0I0 splits the backward .* also has the full backward 0B0"),
        ("0F0,0I0\n", r"0I0 has no weight backward: add 0W0 after it on rank 0"),
        ("0F0,0W0\n", r"0W0 has no input backward: add 0I0 before it on rank 0"),
        ("0I0,0F0,0W0\n", r"0I0 runs before its forward 0F0"),
        ("0F0\n", r"0F0 has no backward: add 0B0 \(or 0I0 then 0W0\)"),
    ],
)
def test_split_backward_rules(csv_text: str, message: str) -> None:
    text = check(csv_text, message)
    assert "[" in text  # the offending cell is marked in the grid


def test_update_missing_a_split_backward() -> None:
    with pytest.raises(
        ScheduleError, match=r"0U0 updates .* micro-batch 1 has no backward 0B1 \(or 0W1\)"
    ):
        validate(schedule_from_csv("0F0,0I0,0W0,0U0\n"), micro_batches=2)


def test_split_deadlock_names_the_awaited_input_backward() -> None:
    # rank 0 runs 0I0 before 0F1, but 1I0 on rank 1 waits behind 1F1 which needs 0F1
    text = check("0F0,0I0,0F1,0W0,0I1,0W1\n1F1,1F0,1I0,1W0,1I1,1W1\n", "deadlocks")
    assert "rank 0 waits at 0I0 for 1I0" in text


def test_lowered_order_is_run_not_read_by_columns() -> None:
    order, micro = split_order("1f1b", 3, 3, 1, None)
    lowered = add_communication(retime(order, micro))
    assert [str(a) for a in lowered[1] if a.kind is not Kind.FORWARD][:4] == [
        "1RECV_F0",
        "1SEND_F0",
        "1RECV_F1",
        "1SEND_F1",
    ]
    assert "1RECV_B0" in [str(a) for a in lowered[1]]
    i = [str(a) for a in lowered[1]].index("1I0")
    assert [str(a) for a in lowered[1][i - 1 : i + 2]] == ["1RECV_B0", "1I0", "1SEND_B0"]
    assert validate(lowered, micro) == micro
    # orders that wait on each other still fail, as a deadlock: rank 0 runs 0I0 before 0F1,
    # but 1I0 comes after 1F1 on rank 1, which needs 0F1
    row = list(lowered[0])
    row.insert(1, row.pop(row.index(Action(0, Kind.BACKWARD_INPUT, 0))))
    with pytest.raises(ScheduleError, match="deadlocks") as err:
        validate({**lowered, 0: row}, micro)
    assert "rank 0 waits at 0I0 for 1I0" in str(err.value)


def test_split_backwards_reach_the_arrays_and_versions_like_their_merge() -> None:
    """I and W pass through the array form; the version analysis gives each the version of
    the B they split (the runtime's refusal is tested with the executor)."""
    order, micro = split_order("1f1b", 3, 3, 2, None)
    arrays = OrderArrays.from_order(order)
    merged = OrderArrays.from_order(merge_backward(order))
    original = OrderArrays.from_order(build_schedule("1f1b", 3, 3, 2)[0])
    assert merged.to_order() == original.to_order()
    backwards = int((merged.kind == 1).sum())
    assert arrays.size == merged.size + backwards  # each B is an I and a W
    assert arrays.to_order() == {r: [a for a in acts if a] for r, acts in order.items()}
    for policy in (WeightPolicy.FLUSH, WeightPolicy.STASH):
        split = analyze_versions(retime(order, micro), policy, micro)
        whole = analyze_versions(merge_backward(order), policy, micro)
        assert split.passes == whole.passes and split.updates == whole.updates
        assert split.max_in_flight == whole.max_in_flight
        assert split.weight_copies == whole.weight_copies
        version = split.actions.version.tolist()
        by_name = {arrays.name(i): version[i] for i in range(arrays.size)}
        for (k, j), p in whole.passes.items():
            assert by_name[f"{k}I{j}"] == by_name[f"{k}W{j}"] == p.backward_version
    lone = {0: [Action(0, Kind.FORWARD, 0), Action(0, Kind.BACKWARD_INPUT, 0)]}
    with pytest.raises(ScheduleError, match="0I0 has no other half"):
        analyze_versions(lone, WeightPolicy.FLUSH, 1)
