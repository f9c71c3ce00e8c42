"""The methods as objects: each registered method's stage policy for a small pipeline, the
combinators (a correction keeps its base's schedule, a bounded delay accumulates
A_k = ⌈τ_k/D⌉), and a method added by a module and one registry line."""

from __future__ import annotations

import math

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan import schedules
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.methods import (
    CORRECTED,
    FLUSHING,
    METHODS,
    Method,
    StagePolicy,
    WeightPolicy,
    build_schedule,
    get_method,
    registered,
)
from pipeoptim.plan.methods.combinators import bounded, corrected
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.engine import simulate

P = 4

SYNC = ("mini-batch version", "mini-batch version")
STASH = ("latest", "stashed")
PREDICT = ("predicted", "latest")
PIPEDREAM_ROW = ([4, 3, 2, 1], STASH, None)
PIPEOPTIM_ROW = ([2, 2, 2, 1], PREDICT, "optimizer")
# per method, for P = 4: weight copies per stage, what a forward and a backward read, the
# predictor
COPIES_READS_PREDICTOR: dict[str, tuple[list[int], tuple[str, str], str | None]] = {
    "gpipe": ([1, 1, 1, 1], SYNC, None),
    "1f1b": ([1, 1, 1, 1], SYNC, None),
    "interleaved-1f1b": ([1, 1, 1, 1], SYNC, None),
    "pipedream": PIPEDREAM_ROW,
    "2bw": ([2, 2, 2, 2], ("one behind", "one behind"), None),
    "spectrain": ([2, 2, 2, 1], PREDICT, "spectrain"),
    "xpipe": ([2, 2, 2, 1], PREDICT, "xpipe"),
    "pipeoptim": PIPEOPTIM_ROW,
    "zb-h1": ([1, 1, 1, 1], SYNC, None),
    "zb-v": ([1, 1, 1, 1], SYNC, None),
    "dualpipev": ([1, 1, 1, 1], SYNC, None),
    "interleaved-zb": ([1, 1, 1, 1], SYNC, None),
    "pipeoptim+shrink": ([2, 2, 2, 1], PREDICT, "shrunk"),
    "pipedream+pipemare": PIPEDREAM_ROW,
    "pipeoptim+pipemare": PIPEOPTIM_ROW,
    "pipedream+nesterov": PIPEDREAM_ROW,
    "pipeoptim+nesterov": PIPEOPTIM_ROW,
    "pipedream+qk-clip": PIPEDREAM_ROW,
    "pipeoptim+qk-clip": PIPEOPTIM_ROW,
    # the extrapolation keeps the previous update: one more weight-sized buffer
    "xpipe+extrapolate": ([3, 3, 3, 2], PREDICT, "xpipe"),
    "2bw+extrapolate": ([3, 3, 3, 3], ("one behind", "one behind"), None),
    "pipeoptim+extrapolate": ([3, 3, 3, 2], PREDICT, "optimizer"),
    # a forward meets at most one update: one older version at most
    "pipedream+bounded": ([2, 2, 2, 1], STASH, None),
    "pipeoptim+bounded": PIPEOPTIM_ROW,
}
CORRECTION = {
    "pipedream+pipemare": "pipemare-lr",
    "pipeoptim+pipemare": "pipemare-lr",
    "pipedream+nesterov": "delay-momentum",
    "pipeoptim+nesterov": "delay-momentum",
    "pipedream+qk-clip": "qk-clip",
    "pipeoptim+qk-clip": "qk-clip",
    "xpipe+extrapolate": "extrapolate",
    "2bw+extrapolate": "extrapolate",
    "pipeoptim+extrapolate": "extrapolate",
}
BOUNDED_ACCUMULATION = [3, 2, 1, 1]  # A_k = ⌈(P-1-k)/1⌉, at least 1
SPLIT_BACKWARD = {"zb-h1", "zb-v", "dualpipev", "interleaved-zb"}
FLUSHED = {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev", "interleaved-zb"}


def test_every_registered_method_has_its_expected_stage_policies_for_four_stages() -> None:
    assert sorted(COPIES_READS_PREDICTOR) == sorted(METHODS)
    for name, (copies, (forward, backward), predictor) in COPIES_READS_PREDICTOR.items():
        policies = [get_method(name).stage_policy(k, P) for k in range(P)]
        assert all(isinstance(p, StagePolicy) for p in policies)
        assert [p.stage for p in policies] == list(range(P))
        assert [p.weight_copies for p in policies] == copies, name
        assert {p.forward_reads for p in policies} == {forward}, name
        assert {p.backward_reads for p in policies} == {backward}, name
        assert {p.predictor for p in policies} == {predictor}, name
        assert {p.predicts for p in policies} == {predictor is not None}, name
        assert {p.stashes for p in policies} == {backward == "stashed"}, name
        assert {p.double_buffers for p in policies} == {forward == "one behind"}, name
        assert {p.correction for p in policies} == {CORRECTION.get(name)}, name
        acc = BOUNDED_ACCUMULATION if name.endswith("+bounded") else [1] * P
        assert [p.accumulation for p in policies] == acc, name
        assert {p.splits_backward for p in policies} == {name in SPLIT_BACKWARD}, name
        assert {p.flushes for p in policies} == {name in FLUSHED}, name
        assert {p.keeps_one_version for p in policies} == {name in FLUSHED}, name


def test_the_memory_model_counts_the_copies_the_stage_policy_says() -> None:
    for name, method in METHODS.items():
        factors = method_memory_factors(name, P, P)
        assert [factors(k, P)[0] for k in range(P)] == [
            method.stage_policy(k, P).weight_copies for k in range(P)
        ]


def test_the_methods_questions_answer_as_their_rules_say() -> None:
    assert FLUSHING == (
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "zb-h1",
        "zb-v",
        "dualpipev",
        "interleaved-zb",
    )
    whole = {n for n, m in METHODS.items() if m.runs_whole_mini_batches}
    assert whole == {"pipedream", "spectrain", "pipeoptim+bounded"} | {
        n for n in METHODS if n.startswith("pipedream+")
    }
    # pipeoptim's M is a dial, whole mini-batches unless asked (its corrections keep it)
    dials = {n for n, m in METHODS.items() if m.dials_micro_batches}
    assert dials == {"pipeoptim"} | {
        n for n in METHODS if n.startswith("pipeoptim+") and n != "pipeoptim+bounded"
    }
    assert not any(METHODS[n].micro_batched_by_default for n in whole | dials)
    assert get_method("pipedream").micro_batches_for(8) == 1
    assert get_method("2bw").micro_batches_for(8) == 8
    assert get_method("2bw").micro_batches_for(None) is None
    assert get_method("pipeoptim").micro_batches_for(None) == 1
    several = {n for n, m in METHODS.items() if m.places_several_stages_per_rank}
    assert several == {"interleaved-1f1b", "zb-v", "dualpipev", "interleaved-zb"}
    assert get_method("interleaved-1f1b").virtual_stages_for(3) == 3
    assert get_method("1f1b").virtual_stages_for(3) is None
    assert [get_method(n).default_virtual_stages for n in ("1f1b", "zb-v")] == [1, 2]
    assert get_method("zb-h1").passes_per_micro_batch == 3
    assert get_method("gpipe").passes_per_micro_batch == 2
    assert get_method("pipeoptim+nesterov").schedule_family == "pipeoptim"
    assert get_method("pipeoptim+bounded").schedule_family == "pipeoptim+bounded"


def test_a_stage_outside_the_pipeline_is_refused_with_the_range() -> None:
    with pytest.raises(PlanError, match=r"stage index 4 is outside 0\.\.3 for 4 stages"):
        get_method("1f1b").stage_policy(4, 4)


def test_a_correction_keeps_its_bases_schedule_versions_and_memory() -> None:
    corrections = ("pipemare", "nesterov", "qk-clip")
    extrapolating = {f"{b}+extrapolate" for b in ("xpipe", "2bw", "pipeoptim")}
    assert {f"{b}+{c}" for b in ("pipedream", "pipeoptim") for c in corrections} == (
        CORRECTED - extrapolating
    )
    for name in CORRECTED:
        method = get_method(name)
        base = get_method(method.schedule_family)
        assert name.startswith(base.name + "+")
        shape = base.shape(P)
        assert method.shape(P) == shape
        assert method.order(shape) == base.order(shape)
        assert method.version_rule is base.version_rule
        assert method.predictor == base.predictor
        for k in range(P):
            mine, theirs = method.stage_policy(k, P), base.stage_policy(k, P)
            # the extrapolation's kept update is one more weight-sized buffer
            assert mine.weight_copies == theirs.weight_copies + (name in extrapolating)
            assert mine.accumulation == theirs.accumulation
            assert theirs.correction is None and mine.correction == method.correction
    made = corrected(get_method("2bw"), "pipemare-lr", "pipemare", "a test")
    assert made.name == "2bw+pipemare"
    assert made.order(made.shape(P)) == get_method("2bw").order(get_method("2bw").shape(P))


def test_a_bounded_delay_accumulates_the_ceiling_of_the_delay_over_the_bound() -> None:
    for max_delay in (1, 2, 3):
        method = bounded(get_method("pipedream"), max_delay)
        assert method.name == "pipedream+bounded"
        for p in range(1, 8):
            delays = [p - 1 - k for k in range(p)]  # τ_k of asynchronous 1F1B
            assert [method.stage_policy(k, p).accumulation for k in range(p)] == [
                max(1, math.ceil(tau / max_delay)) for tau in delays
            ]
    # its own schedule: stage k updates ⌈N/A_k⌉ times in N mini-batches (a last, partial
    # accumulation updates too), the early stages rarer
    method = get_method("pipeoptim+bounded")
    shape = method.shape(P, None, 8)
    updates = {
        rank: sum(a is not None and a.kind == "U" for a in acts)
        for rank, acts in method.order(shape).items()
    }
    assert updates == {0: 3, 1: 4, 2: 8, 3: 8}


def _gpipe_late_update(shape: schedules.Shape) -> schedules.Order:
    """A throwaway schedule: gpipe's order (what a method module would define)."""
    return schedules.gpipe(shape)


def test_a_method_from_a_module_and_one_registry_line_is_found_and_simulates() -> None:
    throwaway = Method(
        "test-gpipe-twin",
        "gpipe's order under another name, for this test only",
        _gpipe_late_update,
        WeightPolicy.FLUSH,
        slots_rule=lambda k, p, m: m,
    )
    with pytest.raises(PlanError, match="unknown method 'test-gpipe-twin'"):
        get_method(throwaway.name)
    with registered(throwaway):
        assert get_method("test-gpipe-twin") is throwaway
        schedule, shape = build_schedule("test-gpipe-twin", 3, 3)
        assert (shape.num_ranks, shape.micro_batches, shape.virtual_stages) == (3, 3, 1)
        assert schedule == build_schedule("gpipe", 3, 3)[0]
        costs = CostModel.uniform(3, 1.0, 2.0, 0.5)
        mine = simulate("test-gpipe-twin", shape, costs)
        theirs = simulate("gpipe", shape, costs)
        assert mine.events == theirs.events
        assert mine.meta["makespan"] == theirs.meta["makespan"] > 0
        factors = method_memory_factors("test-gpipe-twin", 3, 3)
        assert [factors(k, 3) for k in range(3)] == [(1, 3), (1, 3), (1, 3)]
        with pytest.raises(PlanError, match="already registered"), registered(throwaway):
            pass
    assert "test-gpipe-twin" not in METHODS
    with pytest.raises(PlanError, match="unknown method 'test-gpipe-twin'"):
        get_method("test-gpipe-twin")


def test_each_weight_rule_answers_the_questions_its_readers_ask() -> None:
    # (keeps one version, keeps past versions, reads predicted) per rule
    answers = {
        rule.value: (rule.keeps_one_version, rule.keeps_past_versions, rule.reads_predicted)
        for rule in WeightPolicy
    }
    assert answers == {
        "flush": (True, False, False),
        "stash": (False, True, False),
        "double-buffer": (False, True, False),
        "predict": (False, False, True),
    }
