"""Each rank's forwards first on the local transport (``Pipeline(forwards_first=True)``).

The pass (``plan.passes.forwards_first``) moves each rank's forwards between two of its
updates ahead of its backwards there. That keeps every pass's weight version and every
gradient's order of summation, so the run trains the weights of the schedule's own order
bit for bit; what changes is only which action one thread runs next (issue 34).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from support import tied_worker
from support.gpt import tiny_gpt, trained_pipeline

from pipeoptim.errors import RuntimeConfigError, ScheduleError
from pipeoptim.plan.actions import Action, Kind
from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.plan.passes import forwards_first, runs_to_the_end
from pipeoptim.plan.schedules import Order, retime
from pipeoptim.plan.shape import Shape
from pipeoptim.plan.versions import analyze_versions
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.segments import segment_plan


def rows(order: Order) -> dict[int, str]:
    return {r: " ".join(str(a) for a in acts if a is not None) for r, acts in order.items()}


def parsed(rows_: dict[int, str]) -> Order:
    return {r: [Action.parse(a) for a in text.split()] for r, text in rows_.items()}


# -- the pass --------------------------------------------------------------------------------
def test_xpipe_at_two_stages_runs_each_intervals_forwards_first() -> None:
    order = get_method("xpipe").order(Shape(2, 2, 2))
    assert rows(order) == {
        0: "0F0 0F1 0B0 0F2 0B1 0U0 0F3 0B2 0B3 0U1",
        1: "1F0 1B0 1F1 1B1 1U0 1F2 1B2 1F3 1B3 1U1",
    }
    assert rows(forwards_first(order)) == {
        0: "0F0 0F1 0F2 0B0 0B1 0U0 0F3 0B2 0B3 0U1",
        1: "1F0 1F1 1B0 1B1 1U0 1F2 1F3 1B2 1B3 1U1",
    }


def test_a_split_backward_keeps_its_halves_in_order_behind_the_forwards() -> None:
    order = parsed({0: "0F0 0I0 0F1 0W0 0I1 0W1 0U0"})
    assert rows(forwards_first(order)) == {0: "0F0 0F1 0I0 0W0 0I1 0W1 0U0"}


@pytest.mark.parametrize("name", METHODS)
def test_every_method_meets_the_same_versions_and_runs_to_the_end(name: str) -> None:
    method = get_method(name)
    virtual = 2 if method.name in ("interleaved-1f1b", "zb-v") else 1
    checked = 0
    for p in (2, 3, 4, 8):
        for m in (1, 2, 4, 8):
            for n in (1, 3):
                try:
                    order = method.order(Shape(p, m, n, virtual))
                    before = analyze_versions(order, method.weight_policy, m)
                except Exception:  # a shape the method refuses
                    continue
                grouped = forwards_first(order)
                after = analyze_versions(grouped, method.weight_policy, m)
                assert runs_to_the_end(grouped, m), (name, p, m, n)
                assert after.passes == before.passes, (name, p, m, n)
                assert after.updates == before.updates, (name, p, m, n)
                assert after.weight_copies == before.weight_copies, (name, p, m, n)
                checked += 1
    assert checked >= 8


# Stage 1 runs 1F1 before its update of mini-batch 0; grouped, 1F1 would wait for 0F1,
# which waits behind 0U0, which waits for 1B0, which waits behind 1F1.
HELD = {0: "0F0 0B0 0U0 0F1 0B1 0U1", 1: "1F0 1B0 1F1 1U0 1B1 1U1"}


def test_an_order_whose_grouped_form_would_wait_forever_keeps_its_own() -> None:
    order = parsed(HELD)
    assert runs_to_the_end(order, 1)
    assert not runs_to_the_end(forwards_first(order), 1)
    with pytest.raises(ScheduleError, match="deadlocks"):  # the clock grid's verdict too
        retime(forwards_first(order), 1)
    method = dataclasses.replace(
        get_method("pipedream"), name="held", generator=lambda shape: parsed(HELD)
    )
    shape = Shape(2, 1, 2)
    assert segment_plan(method, shape, True).actions == segment_plan(method, shape).actions


def test_a_rank_that_never_runs_a_dependency_does_not_run_to_the_end() -> None:
    assert not runs_to_the_end(parsed({0: "0F0 0B0 0U0", 1: "1B0 1F0 1U0"}), 1)


# -- the runtime -----------------------------------------------------------------------------
def weights(pipe: Pipeline) -> list[torch.Tensor]:
    return [p.detach() for s in pipe.stages.values() for p in s.module.parameters()]


CASES = [
    ("xpipe", {}),
    ("xpipe", {"micro_batches": 2}),  # M < P: predictions two updates ahead
    ("xpipe", {"micro_batches": 8}),
    ("xpipe", {"recompute": "full"}),
    ("xpipe", {"amp": "bf16"}),
    ("xpipe", {"predicted_backward": True}),
    ("2bw", {}),
    ("pipedream", {}),
    ("pipeoptim", {}),
    ("1f1b", {}),
    ("zb-h1", {}),
    ("interleaved-1f1b", {"stages": 2, "virtual_stages": 2}),
]


@pytest.mark.parametrize(("method", "options"), CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_forwards_first_trains_the_weights_of_the_schedules_order_bit_for_bit(
    method: str, options: dict[str, Any]
) -> None:
    own, own_losses = trained_pipeline(method, **options)
    first, first_losses = trained_pipeline(method, forwards_first=True, **options)
    assert first_losses == own_losses
    for a, b in zip(weights(first), weights(own), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def runs_of_forwards(pipe: Pipeline, stage: int) -> int:
    """The longest run of consecutive forwards among ``stage``'s compute in the trace."""
    events = [e for e in pipe.rank_result().events if e.stage == stage]
    kinds = [e.kind for e in sorted(events, key=lambda e: e.start) if Kind(e.kind).is_compute]
    longest = current = 0
    for kind in kinds:
        current = current + 1 if kind == Kind.FORWARD.value else 0
        longest = max(longest, current)
    return longest


def test_xpipe_runs_a_middle_stages_forwards_of_an_interval_back_to_back() -> None:
    own, _ = trained_pipeline("xpipe", steps=3)
    first, _ = trained_pipeline("xpipe", steps=3, forwards_first=True)
    assert runs_of_forwards(own, 1) < 4  # the schedule alternates after its warm-up
    assert runs_of_forwards(first, 1) >= 4  # M = 4 forwards between two updates


class StopAtStep:
    """Asks the fit to stop at its first log point at or after ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, info: Any, pipeline: Any) -> None:
        if info.step >= self.step:
            info.request_stop()


def test_a_segment_a_callback_may_cut_keeps_the_schedules_order_and_stops_alike() -> None:
    stop = {"steps": 8, "callbacks": [StopAtStep(2)]}
    own, own_losses = trained_pipeline("xpipe", **stop)
    first, first_losses = trained_pipeline("xpipe", forwards_first=True, **stop)
    assert len(first_losses) == len(own_losses) < 8
    assert first_losses == own_losses
    assert runs_of_forwards(first, 1) == runs_of_forwards(own, 1)
    for a, b in zip(weights(first), weights(own), strict=True):
        assert torch.equal(a, b)


def test_forwards_first_is_refused_off_the_local_transport_and_as_a_non_bool() -> None:
    with pytest.raises(RuntimeConfigError, match="forwards_first orders the ranks"):
        Pipeline(tiny_gpt(), method="xpipe", stages=2, transport="dist", forwards_first=True)
    with pytest.raises(RuntimeConfigError, match="forwards_first must be True or False"):
        Pipeline(tiny_gpt(), method="xpipe", stages=2, forwards_first=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("method", "stages", "micro"), [("1f1b", 3, 4), ("interleaved-1f1b", 2, 4), ("zb-v", 2, 4)]
)
def test_a_tied_weight_updates_alike_with_forwards_first(
    method: str, stages: int, micro: int
) -> None:
    """A tied weight's update waits for both members' gradients (``ties.py``), outside the
    order the pass checks: the grouped run still finishes and trains the same weights."""
    own = tied_worker.tied_pipeline(method, stages, micro)
    first = tied_worker.tied_pipeline(method, stages, micro, forwards_first=True)
    own_losses = own.fit(tied_worker.batches(5), max_steps=5).losses
    first_losses = first.fit(tied_worker.batches(5), max_steps=5).losses
    assert first_losses == own_losses
    for a, b in zip(weights(first), weights(own), strict=True):
        assert torch.equal(a, b)
