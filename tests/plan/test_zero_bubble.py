"""Zero-bubble schedules: exact tables, validation sweeps, memory, bubbles, PyTorch's ZB-V."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan.actions import Action, B, F, Kind, U, compact, format_schedule
from pipeoptim.plan.schedules import dependencies, one_f_one_b
from pipeoptim.plan.shape import Shape
from pipeoptim.plan.validate import validate
from pipeoptim.plan.zero_bubble import zb_h1, zb_h1_order, zb_v, zb_v_order

I, W = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741 - the paper's names


def table(schedule: Mapping[int, Sequence[Action | None]]) -> dict[int, str]:
    return {r: " ".join(c or "." for c in row) for r, row in format_schedule(schedule).items()}


# Hand derivations. Rule for stage k (P stages, M micro-batches): P-1-k warm-up F's; rounds
# F, I(oldest), and from round k on W(oldest waiting); cool-down I, W pairs; the k waiting
# W's; U. Placement: each action at the first step after its rank's previous action and its
# dependencies (F after the previous stage's F, I after its F and the next stage's I, W
# after its I, U after the last W).
#
# P=2, M=2. Orders: rank 0 F0 F1 | I0 W0 | I1 W1 | U;  rank 1 F0 I0 | F1 I1 W0 | W1 | U.
# Times: 0F0@0 0F1@1 1F0@1 1I0@2 1F1@3 1I1@4 1W0@5 1W1@6; 0I0@3 (after 1I0@2, idle @2)
# 0W0@4 0I1@5 (after 1I1@4) 0W1@6; both U@7.
#
# P=3, M=3. Orders: rank 0 F0 F1 | F2 I0 W0 | I1 W1 | I2 W2 | U; rank 1 F0 | F1 I0 |
# F2 I1 W0 | I2 W1 | W2 | U; rank 2 F0 I0 | F1 I1 | F2 I2 W0 | W1 W2 | U.
# Times: rank 2 F0@2 I0@3 F1@4 (1F1@2, rank busy to 3) I1@5 F2@6 (1F2@5) I2@7 W0..W2@8..10;
# rank 1 F0@1 F1@2 I0@4 (2I0@3) F2@5 I1@6 (2I1@5) W0@7 I2@8 (2I2@7) W1@9 W2@10;
# rank 0 F0..F2@0..2 I0@5 (1I0@4) W0@6 I1@7 (1I1@6) W1@8 I2@9 (1I2@8) W2@10; all U@11.
#
# P=4, M=4. Orders: rank 0 F0 F1 F2 | F3 I0 W0 | I1 W1 | I2 W2 | I3 W3 | U;
# rank 1 F0 F1 | F2 I0 | F3 I1 W0 | I2 W1 | I3 W2 | W3 | U;
# rank 2 F0 | F1 I0 | F2 I1 | F3 I2 W0 | I3 W1 | W2 W3 | U;
# rank 3 F0 I0 | F1 I1 | F2 I2 | F3 I3 W0 | W1 W2 W3 | U.
# Times: the F of micro-batch j reaches rank 3 at j+3 while rank 3 alternates F, I, so
# 3F0@3 3I0@4 3F1@5 3I1@6 ...; each I climbs one rank per step (2I0@5 1I0@6 0I0@7), and a
# rank's later I's wait for the one below, filling the gaps with its F's and W's.
ZB_H1 = {
    (2, 2): {
        0: "0F0 0F1 . 0I0 0W0 0I1 0W1 0U0",
        1: ". 1F0 1I0 1F1 1I1 1W0 1W1 1U0",
    },
    (3, 3): {
        0: "0F0 0F1 0F2 . . 0I0 0W0 0I1 0W1 0I2 0W2 0U0",
        1: ". 1F0 1F1 . 1I0 1F2 1I1 1W0 1I2 1W1 1W2 1U0",
        2: ". . 2F0 2I0 2F1 2I1 2F2 2I2 2W0 2W1 2W2 2U0",
    },
    (4, 4): {
        0: "0F0 0F1 0F2 0F3 . . . 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3 0U0",
        1: ". 1F0 1F1 1F2 . . 1I0 1F3 1I1 1W0 1I2 1W1 1I3 1W2 1W3 1U0",
        2: ". . 2F0 2F1 . 2I0 2F2 2I1 2F3 2I2 2W0 2I3 2W1 2W2 2W3 2U0",
        3: ". . . 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3W1 3W2 3W3 3U0",
    },
}


@pytest.mark.parametrize("key", list(ZB_H1), ids=lambda k: f"P{k[0]}-M{k[1]}")
def test_zb_h1_exact_tables(key: tuple[int, int]) -> None:
    assert table(zb_h1(key[0], key[1], 1)) == ZB_H1[key]


def test_zb_h1_orders_match_the_rules_for_p4() -> None:
    got = {r: " ".join(str(a) for a in acts) for r, acts in zb_h1_order(4, 4, 1).items()}
    assert got == {
        0: "0F0 0F1 0F2 0F3 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3 0U0",
        1: "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1I2 1W1 1I3 1W2 1W3 1U0",
        2: "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2I3 2W1 2W2 2W3 2U0",
        3: "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3W1 3W2 3W3 3U0",
    }


# ZB-V, P=2 (stages 0..3; rank 0 holds 0 and 3, rank 1 holds 1 and 2), M=4, from PyTorch's
# rules (2P-1 = 3 <= M, so nothing is dropped). Rank 0 (r=0): warm-up 3 F's of stage 0, no
# pairs, 2 rounds 3F 3I 3W; steady while f1 < f0 or f0 < 4: [0F3] 0I0 0W0 3F2 3I2 3W2, then
# 0I1 0W1 3F3 3I3 3W3; cool-down: no I pairs, 2 rounds 0I 0W. Rank 1 (r=1): 1 F of stage 1,
# 1 pair (2F0 1F1), 1 round 2F1 2I0 2W0; steady 1F2 1I0 1W0 2F1.. etc.
ZB_V_P2_M4 = {
    0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
    "0I2 0W2 0I3 0W3 0U0 3U0",
    1: "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
    "1I3 1W2 2W3 1W3 1U0 2U0",
}


def test_zb_v_order_for_p2() -> None:
    got = {r: " ".join(str(a) for a in acts) for r, acts in zb_v_order(4, 4, 1).items()}
    assert got == ZB_V_P2_M4


def sweep(max_p: int) -> list[tuple[int, int, int]]:
    return [
        (p, m, n) for p in range(1, max_p + 1) for m in (p, p + 1, 2 * p, 3 * p) for n in (1, 3)
    ]


def check_counts(
    schedule: Mapping[int, Sequence[Action | None]], stages: int, m: int, n: int
) -> None:
    acts = [a for row in schedule.values() for a in row if a is not None]
    assert len(acts) == len(set(acts))
    for kind in (F, I, W):
        assert sum(a.kind is kind for a in acts) == stages * m * n
    assert sum(a.kind is U for a in acts) == stages * n
    assert not any(a.kind is B for a in acts)
    assert {a.mb for a in acts if a.kind is U} == set(range(n))


@pytest.mark.parametrize(("p", "m", "n"), sweep(6))
def test_zb_h1_validates(p: int, m: int, n: int) -> None:
    schedule = zb_h1(p, m, n)
    assert validate(schedule, m) == m
    assert validate(schedule) == m
    check_counts(schedule, p, m, n)


@pytest.mark.parametrize(("p", "m", "n"), sweep(4))
def test_zb_v_validates(p: int, m: int, n: int) -> None:
    schedule = zb_v(2 * p, m, n)
    assert validate(schedule, m) == m
    check_counts(schedule, 2 * p, m, n)
    for r, row in schedule.items():  # the V: rank r holds stages r and 2P-1-r
        assert {a.stage for a in row if a is not None} == {r, 2 * p - 1 - r}


def in_flight(
    order: Mapping[int, Sequence[Action | None]], done: frozenset[Kind]
) -> dict[int, int]:
    """Per stage, the most micro-batches whose F ran and whose ``done`` action has not."""
    peak: dict[int, int] = {}
    for row in order.values():
        live: dict[int, int] = {}
        for a in row:
            if a is None:
                continue
            if a.kind is F:
                live[a.stage] = live.get(a.stage, 0) + 1
            elif a.kind in done:
                live[a.stage] -= 1
            peak[a.stage] = max(peak.get(a.stage, 0), live.get(a.stage, 0))
    return peak


@pytest.mark.parametrize(("p", "m", "n"), sweep(6))
def test_zb_h1_has_the_1f1b_footprint(p: int, m: int, n: int) -> None:
    ref = in_flight(one_f_one_b(Shape(p, m, n)), frozenset({B}))
    assert ref == {k: p - k for k in range(p)}
    # activations (F to I): exactly 1F1B's count on every stage
    assert in_flight(zb_h1(p, m, n), frozenset({I})) == ref
    # F to W (what W still keeps): every stage holds the first stage's P, as the paper says
    assert in_flight(zb_h1(p, m, n), frozenset({W})) == dict.fromkeys(range(p), p)


def makespan(order: Mapping[int, Sequence[Action | None]], m: int, cost: Mapping[Kind, int]) -> int:
    """End time of the last compute action (U excluded) when every rank runs its order as
    early as its dependencies allow, actions taking ``cost[kind]`` time units."""
    queues = {r: [a for a in row if a is not None and a.kind is not U] for r, row in order.items()}
    present = {a for q in queues.values() for a in q}
    stages = max(a.stage for a in present) + 1
    forms = present if any(a.kind is I for a in present) else None
    finish: dict[Action, int] = {}
    free = dict.fromkeys(queues, 0)
    pos = dict.fromkeys(queues, 0)
    while any(pos[r] < len(q) for r, q in queues.items()):
        moved = False
        for r, q in queues.items():
            while pos[r] < len(q):
                a = q[pos[r]]
                deps = [d for d in dependencies(a, stages, m, forms) if d in present]
                if not all(d in finish for d in deps):
                    break
                start = max([free[r], *(finish[d] for d in deps)])
                finish[a] = free[r] = start + cost[a.kind]
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    return max(finish.values())


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_zb_h1_bubble_is_a_third_of_1f1b(p: int, factor: int) -> None:
    """The paper's Table 2 with T_F = T_I = T_W = 1 (a full backward B = I + W = 2):
    1F1B's bubble is (P-1)(T_F + T_I + T_W) = 3(P-1) per rank, ZB-H1's (P-1)(T_F + T_I - T_W)
    = P-1. A rank's bubble: its idle steps between the mini-batch's first and last action on
    any rank (one mini-batch, U excluded)."""
    m = factor * p
    busy = m * 3
    one_f = makespan(one_f_one_b(Shape(p, m, 1)), m, {F: 1, B: 2})
    assert one_f - busy == 3 * (p - 1)

    grid = zb_h1(p, m, 1)
    last = max(s for row in grid.values() for s, a in enumerate(row) if a and a.kind is not U)
    for row in grid.values():
        idle = sum(a is None for a in row[: last + 1])
        assert idle == p - 1
    assert makespan(grid, m, {F: 1, I: 1, W: 1}) - busy == p - 1  # the grid is that timing


@pytest.mark.parametrize("p", range(1, 5))
def test_zb_v_bubble(p: int) -> None:
    """With M >= 2P-1 (the V full) the only idle steps of rank r are the r before its first
    forward arrives: no bubble inside the mini-batch, against 1F1B's 3(P'-1) on P' = 2P
    stages. With fewer micro-batches the V is not full and more steps idle."""
    for m in (2 * p - 1, 2 * p, 3 * p, 4 * p):
        grid = zb_v(2 * p, m, 1)
        last = max(s for row in grid.values() for s, a in enumerate(row) if a and a.kind is not U)
        assert [sum(a is None for a in grid[r][: last + 1]) for r in range(p)] == list(range(p))


def test_errors() -> None:
    with pytest.raises(PlanError, match=r"M >= P \(got M=3 micro-batches for P=4 stages\)"):
        zb_h1(4, 3, 1)
    with pytest.raises(PlanError, match="to 4 or more"):
        zb_h1(4, 3, 1)
    with pytest.raises(PlanError, match="at least 1 rank"):
        zb_h1(0, 1, 1)
    with pytest.raises(PlanError, match="at least 1 mini-batch"):
        zb_h1(2, 2, 0)
    with pytest.raises(PlanError, match="at least 1 micro-batch"):
        zb_v(4, 0, 1)
    for bad in (0, 3, -2):
        with pytest.raises(PlanError, match=rf"even and at least 2 \(got {bad}\)"):
            zb_v(bad, 4, 1)
    with pytest.raises(PlanError, match="at least 1 mini-batch"):
        zb_v(4, 4, 0)


def torch_zbv_order(p: int, m: int) -> dict[int, list[str]]:
    pytest.importorskip("torch")
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from support.torch_schedules import mock_stages  # imports torch: only where torch is installed

    out: dict[int, list[str]] = {}
    for r in range(p):
        sched = schedules.ScheduleZBVZeroBubble(mock_stages("ScheduleZBVZeroBubble", r, p), m)
        out[r] = [str(a) for a in sched.pipeline_order[r] if a is not None]
    return out


@pytest.mark.parametrize("p", range(1, 5))
def test_zb_v_matches_torch_order(p: int) -> None:
    for m in sorted({1, 2, p, p + 1, 2 * p - 1, 2 * p, 3 * p}):
        ours = {
            r: [str(a) for a in acts if a.kind is not U]
            for r, acts in compact(zb_v(2 * p, m, 1)).items()
        }
        assert ours == torch_zbv_order(p, m), (p, m)
    # later mini-batches repeat the order with shifted micro-batch ids, then update
    two = compact(zb_v(2 * p, 2 * p, 2))
    for r, acts in two.items():
        first = [a for a in acts if a.kind is not U and a.mb < 2 * p]
        second = [
            Action(a.stage, a.kind, a.mb - 2 * p) for a in acts if a.kind is not U and a.mb >= 2 * p
        ]
        assert first == second
        assert acts[-2:] == [Action(r, U, 1), Action(2 * p - 1 - r, U, 1)]
