"""DualPipeV and interleaved zero bubble as methods: exact tables, PyTorch's orders, the
overlapped step of the Action IR (text, CSV, validation, placement), versions and memory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import (
    Action,
    B,
    F,
    Kind,
    U,
    format_grid,
    format_schedule,
    parse_step,
    schedule_from_csv,
    schedule_to_csv,
)
from pipeoptim.plan.methods import build_schedule, get_method
from pipeoptim.plan.methods.dualpipe_v import dualpipe_v_order, held_micro_batches
from pipeoptim.plan.methods.interleaved_zero_bubble import interleaved_zb_order
from pipeoptim.plan.schedules import retime
from pipeoptim.plan.validate import validate
from pipeoptim.plan.versions import analyze_versions

I, W = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741 - the paper's names


def table(schedule: Mapping[int, Sequence[Action | None]]) -> dict[int, str]:
    return {r: " ".join(c or "." for c in row) for r, row in format_schedule(schedule).items()}


# P=2, M=4: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. Rank 0: 2(P-1) = 2 F's of
# stage 0; 1 pair F0 F3; 1 round I3 W3 F3; steady M-2P+1 = 1 round (0F3;3B1) (3F2;0B0);
# 1 round 3B2 (3F3;0B1); 1 backward round 3B3 then, split from there on, 0I2; 1 round W0,
# 0I3; the waiting W's. Rank 1: no F0-only warm-up; 2 pairs F1 F2; steady 2 rounds, the
# first's first pair run apart (2B0 after 1F2) as the last rank does; then 2 backward
# rounds, the odd rank splitting from the second round's stage-2 backward on.
DUALPIPE_V_P2_M4 = {
    0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B (3F2;0B0)OVERLAP_F_B 3B2 . "
    "(3F3;0B1)OVERLAP_F_B 3B3 0I2 0W2 0I3 0W3 0U0 3U0",
    1: ". 1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B "
    "(2F3;1B1)OVERLAP_F_B 2B2 1B2 . 2I3 1I3 2W3 1W3 1U0 2U0",
}

# P=2, M=2, v=2: rank r holds r and r+2. Warm-up (v-1)P + P-1-r forwards (3, 2); then a
# round per backward: next F, I (last stage first, in groups of P), and from round r on the
# oldest waiting W.
INTERLEAVED_ZB_P2_M2 = {
    0: "0F0 0F1 2F0 2F1 . 2I0 2W0 2I1 2W1 0I0 0W0 0I1 0W1 0U0 2U0",
    1: ". 1F0 1F1 3F0 3I0 3F1 3I1 3W0 1I0 3W1 1I1 1W0 1W1 1U0 3U0",
}


def test_dualpipe_v_exact_table() -> None:
    grid, shape = build_schedule("dualpipev", 2, 4, 1)
    assert shape.virtual_stages == 2 and shape.num_stages == 4
    assert table(grid) == DUALPIPE_V_P2_M4
    assert validate(grid, 4) == 4


def test_interleaved_zb_exact_table() -> None:
    grid, _ = build_schedule("interleaved-zb", 2, 2, 1)
    assert table(grid) == INTERLEAVED_ZB_P2_M2
    assert validate(grid, 2) == 2


def torch_order(name: str, p: int, m: int) -> dict[int, list[str]]:
    pytest.importorskip("torch")
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from support.torch_schedules import mock_stages  # imports torch: only where installed

    sched = getattr(schedules, name)(mock_stages(name, 0, p), m)
    return {r: [str(a) for a in sched.pipeline_order[r] if a is not None] for r in range(p)}


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_dualpipe_v_is_torch_order(p: int) -> None:
    for m in (2 * p, 2 * p + 1, 3 * p):
        ours = {
            r: [c for c in format_schedule({r: acts})[r] if not c.endswith(f"U{0}")]
            for r, acts in dualpipe_v_order(p, m, 1).items()
        }
        assert ours == torch_order("ScheduleDualPipeV", p, m), (p, m)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_interleaved_zb_is_torch_order(p: int) -> None:
    for m in (p, 2 * p, 3 * p):
        ours = {
            r: [str(a) for a in acts if a.kind is not U]
            for r, acts in interleaved_zb_order(p, m, 1, 2).items()
        }
        assert ours == torch_order("ScheduleInterleavedZeroBubble", p, m), (p, m)


@pytest.mark.parametrize("method", ["dualpipev", "interleaved-zb"])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (2, 4), (3, 6), (4, 8), (4, 12)])
def test_schedules_validate_and_keep_one_version(method: str, p: int, m: int) -> None:
    grid, _ = build_schedule(method, p, m, 2)
    assert validate(grid, m) == m
    report = analyze_versions(grid, get_method(method).version_rule, m)
    assert all(report.max_staleness(k) == 0 for k in report.stages)
    assert all(report.weight_copies[k] == 1 for k in report.stages)
    # every overlapped step is a forward then, on the next step, another micro-batch's B
    for row in grid.values():
        for i, a in enumerate(row):
            if a is not None and a.overlapped:
                nxt = row[i + 1]
                assert a.kind is F and nxt is not None and nxt.kind is B and nxt.mb != a.mb


def test_dualpipe_v_below_2p_drops_micro_batches_like_zb_v() -> None:
    """M < 2P (PyTorch refuses it): the 2P order without the missing micro-batches; a
    pair whose backward is gone is a plain forward."""
    for m in (1, 2, 3):
        order = dualpipe_v_order(2, m, 1)
        assert {a.mb for acts in order.values() for a in acts if a.kind is not U} == set(range(m))
        validate(retime(order, m), m)
    assert not any(a.overlapped for acts in dualpipe_v_order(2, 1, 1).values() for a in acts)


# -- the overlapped step in the Action IR ---------------------------------------------------


def test_overlapped_step_text_round_trips() -> None:
    pair = parse_step("(0F7;7B3)OVERLAP_F_B")
    assert pair == [Action(0, F, 7), Action(7, B, 3)]
    assert pair[0].overlapped and not pair[1].overlapped
    assert parse_step(" 2I5 ") == [Action(2, I, 5)]
    assert parse_step("(0F7;7I3)OVERLAP_F_B")[1].kind is I
    csv = "0F0,(0F7;7B3)OVERLAP_F_B,,7W3\n"
    loaded = schedule_from_csv(csv)
    assert loaded[0] == [Action(0, F, 0), Action(0, F, 7), Action(7, B, 3), None, Action(7, W, 3)]
    assert schedule_to_csv(loaded) == csv
    assert "(0F7;" in format_grid(loaded) and "7B3)" in format_grid(loaded)
    # the mark is no part of the action's identity
    assert Action(0, F, 7).overlapping() == Action(0, F, 7)
    assert hash(Action(0, F, 7).overlapping()) == hash(Action(0, F, 7))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("(0B7;7B3)OVERLAP_F_B", "a forward then a backward"),
        ("(0F7;7W3)OVERLAP_F_B", "a forward then a backward"),
        ("(0F7;7X3)OVERLAP_F_B", "malformed action"),
    ],
)
def test_malformed_overlapped_steps_are_refused(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        parse_step(text)
    with pytest.raises(ScheduleError, match="overlapped step"):
        Action.parse("(0F7;7B3)OVERLAP_F_B")


def test_validate_checks_both_halves_of_an_overlapped_step() -> None:
    grid, _ = build_schedule("dualpipev", 2, 4, 1)
    row = list(grid[0])
    step = next(i for i, a in enumerate(row) if a is not None and a.overlapped)
    # a backward marked as an overlapped step's forward
    back = next(i for i, a in enumerate(row) if a is not None and a.kind is B and i > step + 1)
    marked = [a.overlapping() if i == back and a is not None else a for i, a in enumerate(row)]
    with pytest.raises(ScheduleError, match="marked as the forward of an overlapped step"):
        validate({**grid, 0: marked}, 4)
    # an idle step between the pair's halves
    gap = {**grid, 0: [*row[: step + 1], None, *row[step + 1 :]]}
    with pytest.raises(ScheduleError, match=r"needs a backward \(B or I\) of another micro"):
        validate(gap, 4)
    # a pair of one micro-batch (its backward needs its forward: no overlap possible)
    alone = {0: [Action(0, F, 0).overlapping(), Action(0, B, 0)]}
    with pytest.raises(ScheduleError, match="another micro-batch"):
        validate(alone, 1)
    # each half obeys every other rule: the pair's backward without its forward is refused
    pair_b = row[step + 1]
    assert pair_b is not None
    missing = [a for a in row if a != Action(pair_b.stage, F, pair_b.mb)]
    with pytest.raises(ScheduleError, match="has no forward"):
        validate({**grid, 0: missing}, 4)


def test_retime_keeps_an_overlapped_pair_together() -> None:
    """The pair starts when both halves may: here the forward could start at step 1, but
    the backward's gradient arrives later, so both wait."""
    order = {
        0: [Action(0, F, 0), Action(0, F, 1).overlapping(), Action(0, B, 0), Action(0, B, 1)],
        1: [Action(1, F, 0), Action(1, B, 0), Action(1, F, 1), Action(1, B, 1)],
    }
    grid = retime(order, 2)
    assert table(grid)[0] == "0F0 . . (0F1;0B0)OVERLAP_F_B . 0B1"
    assert validate(grid, 2) == 2


# -- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4, 8])
def test_memory_rules(p: int) -> None:
    """DualPipeV holds each stage's parameters once (two different stages per rank, not two
    copies) and, per rank, 2P+1 stage-sized activations (P + 1/2 micro-batches of a rank's
    layers; DualPipe's claim is P+1): stage k holds 2P-k, as 1F1B's stage k of 2P stages;
    interleaved-zb holds what its order holds."""
    dpv, izb = get_method("dualpipev"), get_method("interleaved-zb")
    for m in (2 * p, 4 * p):
        held = held_micro_batches(dualpipe_v_order(p, m, 1))
        for k in range(2 * p):
            assert dpv.weight_copies(k, 2 * p) == 1
            # first leg: stage k holds 2P-k; second leg's stage 2P-1-r holds r+1
            assert dpv.activation_slots(k, 2 * p, m) == held[k] == 2 * p - k
        assert {held[r] + held[2 * p - 1 - r] for r in range(p)} == {2 * p + 1}
        held = held_micro_batches(interleaved_zb_order(p, m, 1, 2))
        assert [izb.activation_slots(k, 2 * p, m) for k in range(2 * p)] == [
            held[k] for k in range(2 * p)
        ]
        assert all(izb.weight_copies(k, 2 * p) == 1 for k in range(2 * p))


def test_held_micro_batches_counts_until_w() -> None:
    order = {
        0: [Action(0, F, 0), Action(0, F, 1), Action(0, I, 0), Action(0, B, 1), Action(0, W, 0)]
    }
    assert held_micro_batches(order) == {0: 2}
