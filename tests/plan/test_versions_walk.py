"""The vectorised version analysis against a plain walk of each stage's actions.

The walk below is the definition: one pass over a stage's actions in execution order,
counting updates, keeping what each policy keeps. The analysis must give the same versions,
copies and in-flight counts on every method's schedule and under every policy.
"""

from __future__ import annotations

from typing import Any

import pytest

from pipeoptim.errors import ScheduleError
from pipeoptim.plan import get_method
from pipeoptim.plan.actions import Action, B, F, Kind, U
from pipeoptim.plan.methods import METHODS, WeightPolicy
from pipeoptim.plan.orders import OrderArrays
from pipeoptim.plan.versions import analyze_order, analyze_versions

CLOSES = (B, Kind.BACKWARD_WEIGHT)
"""What ends a micro-batch's pass on a stage: its B, or the W of a split backward (its I
reads the same weights and changes nothing)."""


def walk(order: dict[int, list[Action]], policy: WeightPolicy, m: int) -> dict[str, Any]:
    per_stage: dict[int, list[Action]] = {}
    for acts in order.values():
        for a in acts:
            per_stage.setdefault(a.stage, []).append(a)
    passes: dict[tuple[int, int], tuple[int, int, int, int, bool]] = {}
    updates: dict[tuple[int, int], tuple[int, int]] = {}
    copies: dict[int, int] = {}
    flight: dict[int, int] = {}
    for k, acts in sorted(per_stage.items()):
        done, at_f, at_b = 0, {}, {}
        for a in acts:
            if a.kind is F:
                at_f[a.mb] = done
            elif a.kind in CLOSES:  # a split backward ends at its W
                at_b[a.mb] = done
            elif a.kind is U:
                done += 1
        for j, base in at_f.items():
            s = at_b[j] - base
            if policy is WeightPolicy.PREDICT:
                fwd = at_b[j]
            elif policy is WeightPolicy.DOUBLE_BUFFER:
                fwd = max(j // m - 1, 0)
                if not fwd <= base <= fwd + 1 or at_b[j] > fwd + 1:
                    raise ScheduleError("two buffers cannot hold it")
            else:
                fwd = base
            passes[(k, j)] = (base, fwd, fwd, s, policy is WeightPolicy.PREDICT and s > 0)
        keeps = policy in (WeightPolicy.STASH, WeightPolicy.DOUBLE_BUFFER)
        current, most, in_flight, stash = 0, 0, set(), {}
        top = 0
        for a in acts:
            if a.kind is F:
                in_flight.add(a.mb)
                if keeps:
                    stash[a.mb] = passes[(k, a.mb)][1]
                extra = 1 if passes[(k, a.mb)][4] else 0
                most = max(most, len(set(stash.values()) | {current}) + extra)
                top = max(top, len(in_flight))
            elif a.kind in CLOSES:
                in_flight.discard(a.mb)
                stash.pop(a.mb, None)
            elif a.kind is U:
                grads = [passes[(k, a.mb * m + q)][2] for q in range(m)]
                updates[(k, a.mb)] = (current, min(grads))
                current += 1
                most = max(most, len(set(stash.values()) | {current}))
        copies[k], flight[k] = max(most, 1), top
    return {"passes": passes, "updates": updates, "copies": copies, "flight": flight}


def analysed(order: dict[int, list[Action]], policy: WeightPolicy, m: int) -> dict[str, Any]:
    r = analyze_versions(order, policy, m)
    return {
        "passes": {
            key: (v.forward_base, v.forward_version, v.backward_version, v.distance, v.predicted)
            for key, v in r.passes.items()
        },
        "updates": {key: (u.applied_to, u.gradient_version) for key, u in r.updates.items()},
        "copies": r.weight_copies,
        "flight": r.max_in_flight,
    }


CASES = [
    (name, p, m, n)
    for name in METHODS
    for p, m, n in [(1, 1, 3), (2, 2, 4), (3, 3, 5), (4, 4, 8), (4, 6, 3), (5, 5, 11)]
    if not (METHODS[name].interleaved and m % p)
]


@pytest.mark.parametrize(("name", "p", "m", "n"), CASES)
@pytest.mark.parametrize("policy", list(WeightPolicy))
def test_analysis_equals_the_walk(name: str, p: int, m: int, n: int, policy: WeightPolicy) -> None:
    method = get_method(name)
    shape = method.shape(p, m if method.micro_batched else None, n)
    order = method.order(shape)
    mm = shape.micro_batches
    try:
        expected = walk(order, policy, mm)
    except ScheduleError:
        with pytest.raises(ScheduleError, match="two buffers cannot hold it"):
            analyze_versions(order, policy, mm)
        return
    assert analysed(order, policy, mm) == expected


def test_stashed_versions_and_the_current_one_count_together() -> None:
    # 0F1 stashes W^1 and 0F2 W^2; both backwards come after the last update, so W^1,
    # W^2 and the current W^3 are alive together: three copies.
    order = {
        0: [
            Action(0, F, 0), Action(0, B, 0), Action(0, U, 0),
            Action(0, F, 1), Action(0, U, 1), Action(0, F, 2), Action(0, U, 2),
            Action(0, B, 1), Action(0, B, 2),
        ]
    }  # fmt: skip
    for policy in (WeightPolicy.STASH, WeightPolicy.FLUSH, WeightPolicy.PREDICT):
        assert analysed(order, policy, 1) == walk(order, policy, 1)
    assert analyze_versions(order, WeightPolicy.STASH, 1).weight_copies == {0: 3}


def test_per_action_versions_follow_the_order_indices() -> None:
    method = get_method("pipedream")
    shape = method.shape(3, None, 6)
    arrays = method.order_arrays(shape)
    report = analyze_order(arrays, method.weight_policy, 1)
    order = arrays.to_order()
    flat = [a for r in arrays.ranks for a in order[r]]
    for i, a in enumerate(flat):
        got = int(report.actions.version[i])
        if a.kind is F:
            assert got == report.passes[(a.stage, a.mb)].forward_version
            assert int(report.actions.distance[i]) == report.passes[(a.stage, a.mb)].distance
        elif a.kind is B:
            assert got == report.passes[(a.stage, a.mb)].backward_version
        else:
            assert got == report.updates[(a.stage, a.mb)].applied_to


def test_bad_orders_are_named() -> None:
    no_backward = {0: [Action(0, F, 0), Action(0, U, 0)]}
    with pytest.raises(ScheduleError, match="0F0 has no backward 0B0"):
        analyze_versions(no_backward, WeightPolicy.FLUSH)
    twice = {0: [Action(0, F, 0), Action(0, F, 0), Action(0, B, 0)]}
    with pytest.raises(ScheduleError, match="0F0 appears twice"):
        analyze_versions(twice, WeightPolicy.FLUSH)
    no_forward = {0: [Action(0, B, 0), Action(0, U, 0)]}
    with pytest.raises(ScheduleError, match="update 0U0 needs micro-batch 0"):
        analyze_versions(no_forward, WeightPolicy.FLUSH)
    far_apart = {0: [Action(0, F, 10**12), Action(0, B, 10**12), Action(0, U, 0)]}
    assert OrderArrays.from_order(far_apart).size == 3
    with pytest.raises(ScheduleError, match="update 0U0 needs micro-batch 0"):
        analyze_versions(far_apart, WeightPolicy.FLUSH)


@pytest.mark.parametrize("policy", list(WeightPolicy))
def test_empty_orders_analyse_to_nothing(policy: WeightPolicy) -> None:
    for order in ({}, {0: []}):
        report = analyze_versions(order, policy)
        assert (report.passes, report.updates, report.weight_copies) == ({}, {}, {})
        assert report.max_distance(0) == report.max_staleness(0) == 0
    one = {0: [Action(0, F, 0), Action(0, B, 0)]}
    assert analysed(one, policy, 1) == walk(one, policy, 1)
