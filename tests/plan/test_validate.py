"""The validator: every rule, with errors that name rank, step and action and show the grid."""

from __future__ import annotations

import pytest

from pipeoptim.errors import ScheduleError
from pipeoptim.plan import build_schedule
from pipeoptim.plan.actions import schedule_from_csv
from pipeoptim.plan.passes import add_communication, strip_communication
from pipeoptim.plan.validate import validate


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
