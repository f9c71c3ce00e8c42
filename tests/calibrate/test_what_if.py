"""What-if predictions from a measured run, the calibrated profile, and a real 2-process run.

A simulated run dressed as a runtime trace has known costs, so a prediction of another
method or shape from it must equal the simulator's run of that method on those costs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from support.traces import add_receive_waits

from pipeoptim.calibrate import (
    calibrate,
    calibrated_profile,
    costs_from_trace,
    policy_excess,
    what_if,
)
from pipeoptim.cli import main
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.runtime_costs import RuntimeCosts
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import compile_method, evaluate_trace
from pipeoptim.trace import Trace

SAMPLES = 8  # per micro-batch


def known_costs(stages: int, scale: float = 1.0) -> CostModel:
    base = CostModel.uniform(
        stages,
        0.010 * scale,
        0.020 * scale,
        0.002 * scale,
        predict_s=0.003 * scale,
        param_bytes=4096,
        activation_bytes=1024,
        samples_per_micro_batch=SAMPLES,
    )
    return dataclasses.replace(  # stages unlike each other
        base,
        forward_s=tuple(f * (1 + 0.25 * k) for k, f in enumerate(base.forward_s)),
        backward_s=tuple(b * (1 + 0.5 * k) for k, b in enumerate(base.backward_s)),
    )


def as_measured(method: str, stages: int, m: int, n: int, costs: CostModel) -> Trace:
    """The simulator's run dressed as the runtime's: its plan, boundaries (one layer per
    stage) and the prediction time of the stages that predicted."""
    plan = Plan(method, stages, micro_batches=m, optimizer=OptimizerSpec("sgd", 0.1))
    shape = plan.shape(n)
    trace = evaluate_trace(method, shape, costs)
    add_receive_waits(trace)
    predicting = compile_method(method, shape).versions().pass_arrays
    stages_predicting = sorted(set(predicting.stage[predicting.predicted].tolist()))
    trace.meta.update(
        source="runtime",
        plan=plan.to_dict(),
        batch_size=SAMPLES * m,
        mini_batches=n,
        transport="dist",
        boundaries=[[k, k + 1] for k in range(stages)],
        predict_s={str(k): costs.predict_s[k] for k in stages_predicting},
    )
    return trace


def per_batch(trace: Trace) -> float:
    return float(trace.meta["batch_size"]) / compute_metrics(trace).steady_throughput


@pytest.mark.parametrize(
    ("measured", "m", "target", "target_m"),
    [
        ("pipeoptim", 1, "pipedream", None),
        ("pipeoptim", 1, "spectrain", None),
        ("pipedream", 1, "gpipe", 1),
        ("1f1b", 4, "gpipe", 4),
        ("1f1b", 4, "2bw", 4),
        ("xpipe", 4, "1f1b", 4),
    ],
)
def test_predict_another_method_recovers_the_known_costs(
    measured: str, m: int, target: str, target_m: int | None
) -> None:
    costs = known_costs(4)
    run = as_measured(measured, 4, m, 12, costs)
    recovered = costs_from_trace(run)
    assert recovered.forward_s == pytest.approx(costs.forward_s)
    got = what_if(run, target, micro_batches=target_m)
    shape = get_method(target).shape(4, target_m, 12)
    truth = evaluate_trace(target, shape, costs)
    truth.meta["batch_size"] = SAMPLES * shape.micro_batches
    assert got.time_per_mini_batch == pytest.approx(per_batch(truth), rel=1e-9)
    assert got.metrics.bubble_ratio == pytest.approx(compute_metrics(truth).bubble_ratio)


def test_predict_from_a_non_predicting_run_estimates_the_prediction() -> None:
    costs = known_costs(3)
    run = as_measured("pipedream", 3, 1, 9, costs)  # no prediction measured
    assert calibrated_profile(run).meta["predict_estimated"] == [0, 1, 2]
    got = what_if(run, "pipeoptim")
    assert got.notes and "prediction time estimated" in got.notes[0]
    # estimated as the update time: the same as simulating with predict_s = update_s
    estimate = dataclasses.replace(costs, predict_s=costs.update_s)
    truth = evaluate_trace("pipeoptim", get_method("pipeoptim").shape(3, None, 9), estimate)
    truth.meta["batch_size"] = SAMPLES
    assert got.time_per_mini_batch == pytest.approx(per_batch(truth), rel=1e-9)
    # an offline profile's prediction times replace the estimate
    offline = Profile.from_costs([1.0] * 3, [2.0] * 3, [1024] * 3, [4096] * 3)
    offline = dataclasses.replace(
        offline,
        layers=tuple(dataclasses.replace(x, predict_s=0.003) for x in offline.layers),
    )
    exact = what_if(run, "pipeoptim", profile=offline)
    truth = evaluate_trace("pipeoptim", get_method("pipeoptim").shape(3, None, 9), costs)
    truth.meta["batch_size"] = SAMPLES
    assert exact.time_per_mini_batch == pytest.approx(per_batch(truth), rel=1e-9)


def test_fewer_stages_repartition_the_measured_layers() -> None:
    costs = CostModel.uniform(4, 0.01, 0.02, 0.002, param_bytes=4096, samples_per_micro_batch=8)
    run = as_measured("1f1b", 4, 4, 6, costs)
    got = what_if(run, "1f1b", stages=2, micro_batches=4)
    assert got.num_stages == 2 and "re-partitioned into 2 stages" in got.notes[0]
    # two layers per stage: every cost doubles
    doubled = CostModel.uniform(2, 0.02, 0.04, 0.004, param_bytes=8192, samples_per_micro_batch=8)
    truth = evaluate_trace("1f1b", get_method("1f1b").shape(2, 4, 6), doubled)
    truth.meta["batch_size"] = 32
    assert got.time_per_mini_batch == pytest.approx(per_batch(truth), rel=1e-9)


def test_calibrated_profile_round_trip_through_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """calibrate --out-profile, then simulate --profile: the calibrated prediction again."""
    run_path, profile_path = tmp_path / "run.json", tmp_path / "calibrated.json"
    as_measured("pipeoptim", 3, 1, 9, known_costs(3)).save(run_path)
    argv = ["calibrate", "--trace", str(run_path), "--out-profile", str(profile_path), "--json"]
    assert main(argv) == 0
    calibrated = json.loads(capsys.readouterr().out)
    rows = {r["quantity"]: r for r in calibrated["rows"]}
    predicted = rows["time per mini-batch (steady state)"]["predicted"]
    argv = ["simulate", "--profile", str(profile_path), "--method", "pipeoptim", "--stages", "3"]
    assert main([*argv, "--mini-batches", "9", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"]["pipeoptim"]
    assert SAMPLES / run["steady_throughput"] == pytest.approx(predicted, rel=1e-9)
    assert run["peak_memory_bytes"] == rows["peak memory, fullest rank"]["predicted"]


def test_calibrate_predict_cli_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_path, html = tmp_path / "run.json", tmp_path / "report.html"
    as_measured("1f1b", 2, 4, 4, known_costs(2)).save(run_path)
    argv = ["calibrate", "--trace", str(run_path), "--predict", "gpipe,pipeoptim"]
    assert main([*argv, "--micro-batches", "4", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "what if, from the measured costs:" in out
    lines = [line.split() for line in out.splitlines() if line.startswith(("gpipe ", "pipeoptim "))]
    assert [(row[0], row[1], row[2]) for row in lines] == [
        ("gpipe", "2", "4"),
        ("pipeoptim", "2", "4"),  # the dial takes the given M, as train --micro-batches does
    ]
    assert "pipeoptim: prediction time estimated" in out  # 1f1b measured no prediction
    page = html.read_text()
    for text in ("rank 0 measured", "rank 0 simulated", "what if", "peak memory, fullest rank"):
        assert text in page
    assert main(["calibrate", "--trace", str(run_path), "--predict", "warp"]) == 2
    assert "unknown method 'warp'" in capsys.readouterr().err
    assert main(["calibrate", "--trace", str(run_path), "--stages", "3"]) == 2
    assert "add --predict METHOD" in capsys.readouterr().err


def test_a_real_two_process_run_is_predicted_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 gloo processes; the run's own costs predict its time per mini-batch within 25%
    (the benchmark measures a few percent on a quiet machine; CI machines are noisy). The
    model is the benchmark's, where compute, not messaging latency, fills each action."""
    model = str(Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity_model.py")
    trace_path = tmp_path / "run.json"
    argv = ["train", "--method", "pipeoptim", "--stages", "2", "--transport", "dist"]
    argv += ["--model", f"{model}:build", "--batch-size", "128", "--max-steps", "24"]
    argv += ["--quiet", "--trace", str(trace_path)]
    argv += ["--timeout", "60"]
    assert main(argv) == 0, capsys.readouterr().err
    measured = Trace.load(trace_path)
    assert measured.meta["boundaries"] and measured.meta["threads"] >= 1
    assert set(measured.meta["predict_s"]) == {"0"}  # the last stage never predicts
    _, rows = calibrate(measured)
    by_name = {r.quantity: r for r in rows}
    assert abs(by_name["time per mini-batch (steady state)"].relative_error) <= 0.25
    assert by_name["peak memory, fullest rank"].relative_error == 0.0
    other = what_if(measured, "pipedream")
    assert (
        0 < other.time_per_mini_batch < 10 * by_name["time per mini-batch (steady state)"].measured
    )


def test_bad_what_if_inputs_name_the_value_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_path = tmp_path / "run.json"
    run = as_measured("pipeoptim", 3, 1, 6, known_costs(3))
    run.save(run_path)
    base = ["calibrate", "--trace", str(run_path)]
    # a stage count below 1, with --predict
    assert main([*base, "--predict", "gpipe", "--stages", "0"]) == 2
    err = capsys.readouterr().err
    assert "--stages must be at least 1 (got 0)" in err and "Traceback" not in err
    # a profile of another model
    other = tmp_path / "other.json"
    Profile.from_costs([1.0] * 5, [2.0] * 5, [8] * 5, [8] * 5).save(other)
    out_profile = tmp_path / "calibrated.json"
    argv = [*base, "--predict", "gpipe", "--profile", str(other), "--out-profile", str(out_profile)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the profile has 5 layers but the measured run's model has 3" in err
    assert "pass the profile of the model that ran" in err
    assert not out_profile.exists()  # nothing half-written
    # a trace without the layer boundaries the runtime now records
    del run.meta["boundaries"]
    run.save(run_path)
    assert main([*base, "--out-profile", str(out_profile)]) == 2
    assert "the trace records no layer boundaries" in capsys.readouterr().err
    assert main(base) == 0  # calibrating the run itself needs no boundaries


def _with_policies(profile: Profile) -> Profile:
    """``profile`` with each weight policy's measured work per action, as ``pipeoptim
    profile --ranks P`` records it (the synchronous one's already in a flush run's actions)."""
    runtime = RuntimeCosts(
        action_s={"flush": {"F": 0.001, "U": 0.002}, "predict": {"F": 0.004, "U": 0.0025}}
    )
    return dataclasses.replace(profile, runtime_costs=runtime)


def test_policy_excess_is_the_asked_policys_work_beyond_the_measured_ones() -> None:
    runtime = _with_policies(Profile.from_costs([1.0], [2.0], [1], [1])).runtime_costs
    assert policy_excess(runtime, "1f1b", "pipeoptim") == pytest.approx((0.003, 0, 0.0005, 0, 0))
    assert policy_excess(runtime, "pipeoptim", "1f1b") == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert policy_excess(runtime, "1f1b", "gpipe") == (0.0, 0.0, 0.0, 0.0, 0.0)  # both flush
    assert policy_excess(None, "1f1b", "pipeoptim") == (0.0, 0.0, 0.0, 0.0, 0.0)


def test_a_what_if_for_another_weight_policy_charges_its_measured_work_per_action() -> None:
    """A 1f1b run's actions hold a flush's work around the passes; pipeoptim predicted from
    it does a prediction's too: each of its forwards takes the profile's measured 3 ms more
    and each update 0.5 ms (without them, a 1f1b run predicted pipeoptim 28 % fast on
    2 ranks of 16 x Linear(128))."""
    costs = known_costs(2)
    run = as_measured("1f1b", 2, 2, 8, costs)
    offline = Profile.from_costs([1.0] * 2, [2.0] * 2, [1024] * 2, [4096] * 2)
    offline = dataclasses.replace(
        offline, layers=tuple(dataclasses.replace(x, predict_s=0.003) for x in offline.layers)
    )
    plain = what_if(run, "pipeoptim", profile=offline)
    charged = what_if(run, "pipeoptim", profile=_with_policies(offline))
    assert any("weight policy (predict) charged" in note for note in charged.notes)

    def durations(trace: Trace, kind: str) -> list[float]:
        return [e.duration for e in trace.events if e.kind == kind]

    more = {"F": 0.003, "B": 0.0, "U": 0.0005}
    for kind, extra in more.items():
        before, after = durations(plain.trace, kind), durations(charged.trace, kind)
        assert after == pytest.approx([d + extra for d in before], abs=1e-12), kind
    assert charged.time_per_mini_batch > plain.time_per_mini_batch
    # the run's own policy: nothing more
    same = what_if(run, "gpipe", micro_batches=2, profile=_with_policies(offline))
    assert (
        same.time_per_mini_batch
        == what_if(run, "gpipe", micro_batches=2, profile=offline).time_per_mini_batch
    )
