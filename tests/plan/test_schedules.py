"""Exact schedule tables for small cases, and sweeps that every generated schedule validates."""

from __future__ import annotations

from collections import Counter

import pytest

from pipeoptim.errors import PlanError, ScheduleError
from pipeoptim.plan import METHODS, build_schedule, get_method
from pipeoptim.plan.actions import Kind, format_schedule
from pipeoptim.plan.schedules import (
    accumulation_steps,
    async_one_f_one_b,
    bounded_async_one_f_one_b_arrays,
    forward_only,
    retime,
)
from pipeoptim.plan.shape import Shape
from pipeoptim.plan.validate import validate


def table(method: str, p: int, m: int | None, n: int) -> dict[int, str]:
    schedule, _ = build_schedule(method, p, m, n)
    return {r: " ".join(c or "." for c in row) for r, row in format_schedule(schedule).items()}


EXPECTED = {
    ("gpipe", 2, 2, 1): {
        0: "0F0 0F1 . . 0B0 0B1 0U0",
        1: ". 1F0 1F1 1B0 1B1 1U0",
    },
    ("1f1b", 3, 3, 1): {
        0: "0F0 0F1 0F2 . . 0B0 . 0B1 . 0B2 0U0",
        1: ". 1F0 1F1 . 1B0 1F2 1B1 . 1B2 1U0",
        2: ". . 2F0 2B0 2F1 2B1 2F2 2B2 2U0",
    },
    ("pipedream", 3, None, 4): {
        0: "0F0 0F1 0F2 . . 0B0 0U0 0F3 0B1 0U1 . 0B2 0U2 . 0B3 0U3",
        1: ". 1F0 1F1 . 1B0 1U0 1F2 1B1 1U1 1F3 1B2 1U2 . 1B3 1U3",
        2: ". . 2F0 2B0 2U0 2F1 2B1 2U1 2F2 2B2 2U2 2F3 2B3 2U3",
    },
    ("2bw", 2, 2, 2): {
        0: "0F0 0F1 . 0B0 0F2 0B1 0U0 0F3 0B2 . 0B3 0U1",
        1: ". 1F0 1B0 1F1 1B1 1U0 1F2 1B2 1F3 1B3 1U1",
    },
    # fewer micro-batches than a first rank's warm-up: every forward is a warm-up one
    ("pipedream", 4, None, 2): {
        0: "0F0 0F1 . . . . . 0B0 0U0 . 0B1 0U1",
        1: ". 1F0 1F1 . . . 1B0 1U0 . 1B1 1U1",
        2: ". . 2F0 2F1 . 2B0 2U0 . 2B1 2U1",
        3: ". . . 3F0 3B0 3U0 3F1 3B1 3U1",
    },
    ("xpipe", 4, 2, 1): {
        0: "0F0 0F1 . . . . . 0B0 . 0B1 0U0",
        1: ". 1F0 1F1 . . . 1B0 . 1B1 1U0",
        2: ". . 2F0 2F1 . 2B0 . 2B1 2U0",
        3: ". . . 3F0 3B0 3F1 3B1 3U0",
    },
    ("xpipe", 3, 2, 2): {
        0: "0F0 0F1 0F2 . . 0B0 0F3 0B1 0U0 . 0B2 . 0B3 0U1",
        1: ". 1F0 1F1 . 1B0 1F2 1B1 1U0 1F3 1B2 . 1B3 1U1",
        2: ". . 2F0 2B0 2F1 2B1 2U0 2F2 2B2 2F3 2B3 2U1",
    },
    ("interleaved-1f1b", 2, 2, 1): {
        0: "0F0 0F1 2F0 2F1 . 2B0 . 2B1 0B0 0B1 0U0 2U0",
        1: ". 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 1U0 3U0",
    },
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: f"{k[0]}-P{k[1]}")
def test_exact_tables(key: tuple[str, int, int | None, int]) -> None:
    assert table(*key) == EXPECTED[key]


def test_async_methods_share_the_pipeline_and_differ_in_policy() -> None:
    # pipeoptim, spectrain and pipedream run the same never-flushed 1F1B.
    ref = table("pipedream", 3, None, 4)
    assert table("pipeoptim", 3, None, 4) == ref
    assert table("spectrain", 3, None, 4) == ref
    assert table("xpipe", 2, 2, 2) == EXPECTED[("2bw", 2, 2, 2)]


def test_bounded_delay_table() -> None:
    # P = 4, D = 1: stage k updates once per A_k = P-1-k mini-batches (3, 2, 1, 1) and after
    # the last one; every forward meets at most one update before its backward
    spec = get_method("pipeoptim+bounded")
    order = spec.order(spec.shape(4, None, 7))
    assert [" ".join(str(a) for a in order[k]) for k in range(4)] == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0U2 0F6 0B3 0B4 0B5 0U5 0B6 0U6",
        "1F0 1F1 1F2 1B0 1F3 1B1 1U1 1F4 1B2 1F5 1B3 1U3 1F6 1B4 1B5 1U5 1B6 1U6",
        "2F0 2F1 2B0 2U0 2F2 2B1 2U1 2F3 2B2 2U2 2F4 2B3 2U3 2F5 2B4 2U4 2F6 2B5 2U5 2B6 2U6",
        "3F0 3B0 3U0 3F1 3B1 3U1 3F2 3B2 3U2 3F3 3B3 3U3 3F4 3B4 3U4 3F5 3B5 3U5 3F6 3B6 3U6",
    ]
    assert [spec.accumulation(k, 4) for k in range(4)] == [3, 2, 1, 1]


def test_bounded_delay_refuses_micro_batches_and_a_zero_bound() -> None:
    with pytest.raises(ScheduleError, match="whole mini-batches"):
        bounded_async_one_f_one_b_arrays(Shape(4, 2, 3), 1)
    with pytest.raises(ScheduleError, match="at least 1"):
        accumulation_steps(3, 0)
    assert [accumulation_steps(d, 2) for d in range(6)] == [1, 1, 1, 2, 2, 3]


def test_async_never_flushes() -> None:
    # In steady state the first stage starts mini-batch t + P - 1 before updating for t.
    order = async_one_f_one_b(Shape(4, 1, 10))[0]
    text = [str(a) for a in order]
    assert text[:4] == ["0F0", "0F1", "0F2", "0F3"]
    assert text[4:10] == ["0B0", "0U0", "0F4", "0B1", "0U1", "0F5"]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("p", range(1, 9))
def test_every_generated_schedule_validates(method: str, p: int) -> None:
    spec = get_method(method)
    for m in [p, p + 1, 2 * p] if spec.micro_batched else [None]:
        if spec.interleaved and not spec.v_shape and m is not None and m % p:
            continue
        for n in (1, 3, 2 * p + 1):
            schedule, shape = build_schedule(method, p, m, n)
            assert validate(schedule, shape.micro_batches) == shape.micro_batches
            actions = [a for row in schedule.values() for a in row if a is not None]
            stages = shape.num_stages
            # counts: F and B (or I and W) per stage per micro-batch, one U per stage per
            # mini-batch, or per A_k mini-batches (and the last) under a bounded delay
            # (dualpipev mixes the two forms, as PyTorch's DualPipeV does: B in its overlapped
            # steps, I and W in its tail)
            updates = sum(-(-n // spec.accumulation(k, stages)) for k in range(stages))
            kinds = Counter(a.kind for a in actions)
            passes = stages * shape.total_micro_batches
            assert (
                kinds[Kind.FORWARD] == kinds[Kind.BACKWARD] + kinds[Kind.BACKWARD_INPUT] == passes
            )
            assert kinds[Kind.BACKWARD_WEIGHT] == kinds[Kind.BACKWARD_INPUT]
            assert spec.split_backward or not kinds[Kind.BACKWARD_INPUT]
            assert kinds[Kind.UPDATE] == updates and len(actions) == sum(kinds.values())


@pytest.mark.parametrize("m", [1, 2, 5])
def test_gpipe_and_xpipe_accept_fewer_micro_batches_than_stages(m: int) -> None:
    for method in ("gpipe", "xpipe"):
        schedule, shape = build_schedule(method, 4, m, 2)
        validate(schedule, shape.micro_batches)


@pytest.mark.parametrize(
    ("method", "p", "m", "message"),
    [
        ("1f1b", 4, 2, "needs at least as many micro-batches as stages (got 2 micro-batches"),
        ("2bw", 4, 3, "raise --micro-batches to 4 or more"),
        ("interleaved-1f1b", 2, 3, "use --micro-batches 4"),
        ("pipedream", 4, 4, "runs each mini-batch as one unit"),
        ("pipeoptim+bounded", 4, 2, "runs each mini-batch as one unit"),
        ("gpipe", 0, 1, "need at least 1 stage"),
        ("nope", 2, 2, "choose one of: gpipe, 1f1b"),
        ("zb-h1", 4, 3, "zb-h1 needs at least as many micro-batches as stages (got 3"),
    ],
)
def test_bad_shapes_are_rejected_with_the_fix(method: str, p: int, m: int, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(")):
        build_schedule(method, p, m, 2)


def test_zb_v_places_exactly_two_stages_per_rank() -> None:
    with pytest.raises(PlanError, match="exactly 2 stages on every rank, in a V \\(got 3"):
        build_schedule("zb-v", 2, 4, 1, 3)
    schedule, shape = build_schedule("zb-v", 2, 3, 1)  # any M, unlike interleaved-1f1b
    assert (shape.virtual_stages, shape.micro_batches) == (2, 3)
    owners = {a.stage: r for r, acts in schedule.items() for a in acts if a is not None}
    assert owners == {0: 0, 1: 1, 2: 1, 3: 0}  # the V


def test_retime_reports_deadlock_with_blocked_actions() -> None:
    from pipeoptim.plan.actions import Action, B, F

    order = {
        0: [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        1: [Action(1, F, 1), Action(1, B, 1), Action(1, F, 0), Action(1, B, 0)],
    }
    with pytest.raises(ScheduleError, match="deadlocks") as err:
        retime(order, 1)
    assert "rank 0 waits at 0B0 for 1B0" in str(err.value)
    assert "rank 1 waits at 1F1 for 0F1" in str(err.value)


def test_forward_only_evaluation_order_exact_table() -> None:
    """Evaluation: (micro-batch, stage) order per rank, interleaved placement included."""
    order = forward_only({0: 0, 1: 1, 2: 0, 3: 1}, 2)
    assert {r: [str(a) for a in acts] for r, acts in order.items()} == {
        0: ["0F0", "2F0", "0F1", "2F1"],
        1: ["1F0", "3F0", "1F1", "3F1"],
    }
    assert forward_only({0: 0}, 0) == {0: []}
