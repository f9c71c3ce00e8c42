"""The study's rows with settings (issue 65): the dial's rows at M = P/4 and P/2 and the
extrapolation's λ rows, as specs, keys, labels and simulated time. The dial's machinery is
checked with xpipe, which takes any M today."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.profile import Profile
from pipeoptim.study.cells import method_labels, row_micro_batches
from pipeoptim.study.grid import StudyConfig, main_specs, relative_cost
from pipeoptim.study.runs import RunRecord, RunSpec
from pipeoptim.study.tables import peak_copies
from pipeoptim.study.targets import row_seconds_per_sample, simulated_seconds_per_sample

RATES = {"adamw": (2e-3, None)}

CONFIG = StudyConfig(
    "gpt-deep",
    steps=8,
    eval_every=4,
    methods=("gpipe", "xpipe"),
    optimizers=("adamw",),
    stages=(8, 4),
    sweep_stages=8,
    seeds=1,
    rates={"adamw": (2e-3,)},
    high_rate=False,
    pairs=(("gpipe", "muon"), ("xpipe", "muon")),
    twins=("zb-h1",),
    dial=("adamw", "muon"),
    dial_method="xpipe",
    extrapolations=(("pipedream+pipemare", "muon", 0.25),),
    extrapolations_every_depth=(("pipedream+pipemare", "adamw", 0.5),),
    dial_extrapolations=(("muon", 0.25, 0.5),),
)


def test_the_dial_trains_p_over_4_and_p_over_2_without_the_default() -> None:
    assert CONFIG.dial_counts(8) == [2, 4]
    assert CONFIG.dial_counts(4) == [1, 2]  # xpipe's own M = 4 is its plain row
    specs = [
        s
        for s in main_specs(CONFIG, RATES)
        if s.micro_batch_count is not None and s.extrapolation is None
    ]
    assert [(s.label, s.stages) for s in specs] == [
        ("xpipe M=2", 8),
        ("xpipe M=4", 8),
        ("xpipe M=2 (muon)", 8),
        ("xpipe M=4 (muon)", 8),
        ("xpipe M=1", 4),
        ("xpipe M=2", 4),
        ("xpipe M=1 (muon)", 4),
        ("xpipe M=2 (muon)", 4),
    ]
    dial = specs[2]
    assert dial.trained_optimizer == "muon" and dial.micro_batches == 2
    assert dial.key.endswith("/micro_batch_count=2") and "/xpipe M=2 (muon)/" in dial.key
    # the cost model reads the row's own M: fewer micro-batches, a cheaper run
    plain = next(
        s for s in main_specs(CONFIG, RATES) if s.label == "xpipe (muon)" and s.stages == 8
    )
    assert plain.micro_batches == 8 and relative_cost(dial) < relative_cost(plain)


def test_extrapolation_rows_at_the_sweep_depth_and_at_every_depth() -> None:
    specs = [
        s
        for s in main_specs(CONFIG, RATES)
        if s.extrapolation is not None and s.micro_batch_count is None
    ]
    assert [(s.label, s.stages) for s in specs] == [
        ("pipedream+pipemare λ=0.5", 8),
        ("pipedream+pipemare λ=0.25 (muon)", 8),
        ("pipedream+pipemare λ=0.5", 4),
    ]
    assert specs[1].key.endswith("/extrapolation=0.25")
    labels = method_labels(CONFIG)
    assert labels[-4:-2] == ["pipedream+pipemare λ=0.5", "pipedream+pipemare λ=0.25 (muon)"]
    assert {"xpipe M=1", "xpipe M=2 (muon)", "xpipe M=4 (muon)"} <= set(labels)


def test_the_dial_with_the_extrapolation_trains_at_every_depth_with_both_settings() -> None:
    specs = [
        s
        for s in main_specs(CONFIG, RATES)
        if s.extrapolation is not None and s.micro_batch_count is not None
    ]
    # M = round(P / 4): 2 at 8 stages, 1 at 4 (xpipe takes any M)
    assert [(s.label, s.stages, s.micro_batches) for s in specs] == [
        ("xpipe+extrapolate M=2 λ=0.5 (muon)", 8, 2),
        ("xpipe+extrapolate M=1 λ=0.5 (muon)", 4, 1),
    ]
    assert specs[0].key.endswith("/micro_batch_count=2/extrapolation=0.5")
    assert specs[0].trained_optimizer == "muon" and specs[0].method == "xpipe+extrapolate"
    assert method_labels(CONFIG)[-2:] == [
        "xpipe+extrapolate M=1 λ=0.5 (muon)",
        "xpipe+extrapolate M=2 λ=0.5 (muon)",
    ]


def test_a_dial_extrapolation_row_needs_a_share_above_0_and_a_lambda_of_at_least_0() -> None:
    for share, lam in ((0.0, 0.5), (0.25, -1.0), (0.25, float("nan"))):
        with pytest.raises(RuntimeConfigError, match=r"dial_extrapolations .* e\.g\."):
            replace(CONFIG, dial_extrapolations=(("muon", share, lam),))


def test_new_fields_leave_every_existing_key_as_it_was() -> None:
    spec = RunSpec("gpt-deep", "xpipe", "adamw", 2e-3, 8, 0, 2000, 250, trained_optimizer="muon")
    assert spec.key == "gpt-deep/xpipe (muon)/adamw/lr=0.002/P=8/seed=0/steps=2000/B=32/eval=250"
    assert spec.label == "xpipe (muon)" and spec.micro_batches == 8
    timed = replace(spec, steps=700, equal_time=True)
    assert timed.label == spec.label and timed.key.endswith(
        "/steps=700/B=32/eval=250/equal_time=True"
    )
    # an old record (without the new fields) reads back with their defaults
    back = RunRecord.from_dict({**RunRecord(spec, [], None, 1.0).to_dict()})
    assert back.spec == spec


def test_a_dial_or_extrapolation_row_needs_its_method_registered() -> None:
    with pytest.raises(RuntimeConfigError, match="unknown method"):
        replace(CONFIG, extrapolations=(("nope+extrapolate", "muon", 0.5),))
    with pytest.raises(RuntimeConfigError, match="dial_shares"):
        replace(CONFIG, dial_shares=(0.0,))


def test_the_simulated_time_and_copies_follow_the_rows_micro_batches() -> None:
    flat = Profile.uniform(19, forward_s=0.5, backward_s=1.0, batch_size=32)
    # a prediction per micro-batch: fewer micro-batches, fewer predictions per update
    layers = tuple(replace(layer, predict_s=0.3, update_s=0.3) for layer in flat.layers)
    profile = replace(flat, layers=layers)
    plain = simulated_seconds_per_sample(profile, "xpipe", 8)
    assert simulated_seconds_per_sample(profile, "xpipe", 8, 8) == plain  # the default M
    two = simulated_seconds_per_sample(profile, "xpipe", 8, 2)
    assert two < plain
    assert row_seconds_per_sample("xpipe M=2 (muon)", "adamw", 8, profile) == two
    assert row_seconds_per_sample("xpipe (muon)", "adamw", 8, profile) == plain
    assert row_micro_batches("xpipe M=2 (muon)", 8) == 2
    assert row_micro_batches("xpipe (muon)", 8) == 8
    assert peak_copies("xpipe M=2", 8) >= 1
