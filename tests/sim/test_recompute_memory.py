"""The simulator's memory and time with activation recomputation and sharded optimizer state.

Every expected number is computed here from the hand-made profile by the formula of
``pipeoptim.plan.recompute_costs`` (kept = activations of the units not recomputed plus the
input of each run of recomputed units; one more forward of the recomputed units per backward; under
PREDICT the recomputed units' weights held per in-flight predicted micro-batch) and of
``CostModel.with_sharded_optimizer`` (state / D, a ring all-gather per update).
"""

from __future__ import annotations

import json
import math

import pytest

from pipeoptim.cli import main
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.shape import Shape
from pipeoptim.sim.collectives import Cluster, ring_allgather_s
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import compile_method, evaluate_method, evaluate_trace
from pipeoptim.sim.memory import MemoryReport, memory_report

MIB = 2**20
ACTS = [4 * MIB, 1 * MIB, 6 * MIB, 2 * MIB, 3 * MIB, 1 * MIB]
PARAMS = [1 * MIB, 2 * MIB, 1 * MIB, 3 * MIB, 2 * MIB, 1 * MIB]
FORWARD = [0.5, 0.25, 0.75, 0.5, 0.25, 1.0]
INPUT = 2 * MIB  # the model input: input_shape [2, 262144] float32
BOUNDS = [(0, 3), (3, 6)]


def _profile() -> Profile:
    return Profile.from_costs(
        forward_s=FORWARD,
        backward_s=[2 * f for f in FORWARD],
        activation_bytes=ACTS,
        param_bytes=PARAMS,
        names=[f"u{i}:{'Wide' if a > 2 * MIB else 'Thin'}" for i, a in enumerate(ACTS)],
        optimizer="adam",
        batch_size=2,
        meta={"input_shape": [2, 262144], "input_dtype": "torch.float32"},
    )


def _inputs() -> list[int]:
    return [INPUT, *ACTS[:-1]]


def _kept(start: int, end: int, local: set[int]) -> int:
    """Unrecomputed units keep their activations; a run of consecutive recomputed units is
    one region, which keeps only its first unit's input."""
    inputs = _inputs()
    kept = 0
    for i in range(end - start):
        if i not in local:
            kept += ACTS[start + i]
        elif i - 1 not in local:
            kept += inputs[start + i]
    return kept


def test_kept_bytes_extra_forward_and_rebuilt_follow_the_formula() -> None:
    sets = [frozenset({0, 2}), frozenset()]
    costs = CostModel.from_profile(_profile(), BOUNDS, 1, recompute=sets)
    plain = CostModel.from_profile(_profile(), BOUNDS, 1)
    assert costs.activation_bytes == (_kept(0, 3, {0, 2}), sum(ACTS[3:]))
    assert costs.activation_bytes[0] < plain.activation_bytes[0]
    assert costs.recompute_s == (FORWARD[0] + FORWARD[2], 0.0)
    assert costs.rebuilt_activation_bytes == (ACTS[0] + ACTS[2], 0)
    assert costs.held_weight_bytes == (PARAMS[0] + PARAMS[2], 0)
    # the duration table charges the extra forward to B and to a split backward's I
    table = compile_method("1f1b", get_method("1f1b").shape(2, 2, 1)).duration_table(costs)
    s = 2
    assert table[s + 0] == plain.backward_s[0] + FORWARD[0] + FORWARD[2]
    assert table[3 * s + 0] == plain.backward_input_s[0] + FORWARD[0] + FORWARD[2]
    assert table[4 * s + 0] == plain.backward_weight_s[0]  # W does not recompute


def test_micro_batches_scale_the_kept_bytes_and_the_extra_forward() -> None:
    sets = [frozenset({0, 1, 2}), frozenset({1})]
    costs = CostModel.from_profile(_profile(), BOUNDS, 2, recompute=sets)
    assert costs.activation_bytes == (_kept(0, 3, {0, 1, 2}) // 2, _kept(3, 6, {1}) // 2)
    assert costs.recompute_s == (sum(FORWARD[:3]) / 2, FORWARD[4] / 2)


def _report(method: str, shape: Shape, costs: CostModel) -> MemoryReport:
    timing = evaluate_method(method, shape, costs, keep_timing=True).timing
    assert timing is not None
    return memory_report(compile_method(method, shape), timing, costs)


@pytest.mark.parametrize("method", ["1f1b", "gpipe", "pipedream", "2bw"])
def test_non_predicting_methods_keep_only_the_kept_activations(method: str) -> None:
    spec = get_method(method)
    shape = spec.shape(2, 2 if spec.micro_batched else None, 4)
    sets = [frozenset({0, 2}), frozenset({1})]  # units 0, 2 and 4 keep less than they save
    costs = CostModel.from_profile(_profile(), BOUNDS, shape.micro_batches, recompute=sets)
    plain = CostModel.from_profile(_profile(), BOUNDS, shape.micro_batches)
    with_rc, without = _report(method, shape, costs), _report(method, shape, plain)
    for k in (0, 1):
        peak, base = with_rc.peaks[k], without.peaks[k]
        assert peak.activations == base.activations  # the same micro-batches in flight
        assert peak.weight_copies == base.weight_copies  # nothing more held
        assert peak.bytes <= base.bytes
        for report, model in ((with_rc, costs), (without, plain)):
            mine = [s.detail for s in report.samples if s.detail.get(f"stage:{k}") is not None]
            most = max(d["activations"] for d in mine)
            assert most == report.peaks[k].activations * model.activation_bytes[k]
            assert max(d["stash"] for d in mine) == max(
                d["stash"] for d in (s.detail for s in without.samples) if f"stage:{k}" in d
            )


def test_predicting_methods_hold_the_recomputed_weights_per_predicted_micro_batch() -> None:
    method = get_method("pipeoptim")
    shape = method.shape(2, None, 6)
    sets = [frozenset({0, 2}), frozenset({0})]
    costs = CostModel.from_profile(_profile(), BOUNDS, 1, recompute=sets)
    trace = evaluate_trace(method, shape, costs)
    program = compile_method(method, shape)
    predicted = program.flat_versions()[2]
    held_mbs = {
        program.mb[i] for i in range(program.size) if predicted[i] and program.stage[i] == 0
    }
    assert held_mbs  # stage 0 predicts (s = 1)
    stage0 = [s for s in trace.memory if s.rank == 0]
    held = PARAMS[0] + PARAMS[2]
    # every sample's stash is whole weight copies plus a whole number of held Ŵ copies
    extras = {(s.detail["stash"] % sum(PARAMS[:3])) for s in stage0}
    assert extras <= {0, held, 2 * held}
    assert max(s.detail["stash"] for s in stage0) == sum(PARAMS[:3]) + 2 * held
    # the last stage (s = 0) predicts nothing and holds nothing more
    last = [s for s in trace.memory if s.rank == 1]
    assert max(s.detail["stash"] for s in last) == 0


def test_zero_bubble_holds_the_rebuilt_activations_from_i_to_w() -> None:
    method = get_method("zb-h1")
    shape = method.shape(2, 2, 2)
    sets = [frozenset({2}), frozenset()]
    costs = CostModel.from_profile(_profile(), BOUNDS, 2, recompute=sets)
    trace = evaluate_trace(method, shape, costs)
    stage0 = [s.detail["activations"] for s in trace.memory if s.rank == 0]
    kept, rebuilt = costs.activation_bytes[0], costs.rebuilt_activation_bytes[0]
    assert rebuilt == ACTS[2] // 2
    # some sample holds a rebuilt set beside the kept ones, and every one is such a sum
    assert any(a % kept == rebuilt % kept and a > 0 for a in stage0)
    assert all(any(a == i * kept + j * rebuilt for i in range(5) for j in range(3)) for a in stage0)


def test_sharding_divides_the_state_and_adds_the_gather() -> None:
    cluster = Cluster(bandwidth=1e9, latency_s=1e-4)
    base = CostModel.from_profile(_profile(), BOUNDS, 1, update_s=[0.2, 0.4])
    dp = base.with_data_parallel(4, cluster)
    sharded = dp.with_sharded_optimizer(cluster)
    for k, (start, end) in enumerate(BOUNDS):
        state = sum(2 * p for p in PARAMS[start:end])  # adam: two moments
        assert dp.optimizer_state_bytes[k] == state
        assert sharded.optimizer_state_bytes[k] == math.ceil(state / 4)
        gather = ring_allgather_s(sum(PARAMS[start:end]), 4, 1e9, 1e-4)
        assert gather == pytest.approx(3 * 1e-4 + 3 / 4 * sum(PARAMS[start:end]) / 1e9)
        assert sharded.gather_s[k] == gather
        # a predicting replica broadcasts its shard of Ŵ at each predicted forward
        assert sharded.predict_s[k] == dp.predict_s[k] + gather
        assert sharded.update_total_s[k] == pytest.approx(
            base.update_s[k] / 4 + dp.allreduce_s[k] + gather
        )
    # a U action takes the step on 1/D, the all-reduce and the gather
    table = compile_method("1f1b", get_method("1f1b").shape(2, 2, 1)).duration_table(sharded)
    assert table[4:6] == list(sharded.update_total_s)


def test_sharding_refuses_one_replica() -> None:
    with pytest.raises(Exception, match="--data-parallel 2 or more"):
        CostModel.from_profile(_profile(), BOUNDS, 1).with_sharded_optimizer(Cluster())


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_simulate_reads_the_plan_and_the_flags(tmp_path, capsys) -> None:
    profile_path = tmp_path / "profile.json"
    _profile().save(profile_path)
    adam = OptimizerSpec("adam", 1e-3)  # the profile's optimizer
    plan = Plan(
        "1f1b", 2, micro_batches=2, optimizer=adam, boundaries=BOUNDS, recompute=[["u2"], "none"]
    )
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    args = ["--plan", str(plan_path), "--profile", str(profile_path), "--engine", "fast"]
    from_plan = _json(capsys, *args)
    flag = _json(capsys, *args, "--recompute", "units:2")
    plain = _json(capsys, *args, "--recompute", "none")
    by_class = _json(capsys, *args, "--recompute", "units:Wide")  # units 0, 2 and 4
    assert from_plan["recompute_s"] == flag["recompute_s"] == {"1f1b": [FORWARD[2] / 2, 0.0]}
    assert plain["recompute_s"] == {"1f1b": [0.0, 0.0]}
    assert by_class["recompute_s"]["1f1b"] == [(FORWARD[0] + FORWARD[2]) / 2, FORWARD[4] / 2]
    # the command's peaks are the model's for the plan's recomputation
    run = from_plan["runs"]["1f1b"]["shape"]
    shape = get_method("1f1b").shape(2, run["micro_batches"], run["mini_batches"])
    sets = [frozenset({2}), frozenset()]
    model = CostModel.from_profile(_profile(), BOUNDS, 2, recompute=sets)
    want = compute_metrics(evaluate_trace("1f1b", shape, model)).stages
    for k in (0, 1):
        got = from_plan["runs"]["1f1b"]["stages"][str(k)]["peak_memory_bytes"]
        assert got == want[k].peak_memory_bytes
    assert want[0].peak_memory_bytes < plain["runs"]["1f1b"]["stages"]["0"]["peak_memory_bytes"]
    full = _json(capsys, *args, "--recompute", "stages:1")
    assert full["recompute_s"]["1f1b"] == [0.0, sum(FORWARD[3:]) / 2]
    dp = [*args, "--data-parallel", "2", "--bandwidth", "1GB/s", "--batch-size", "4"]
    shard = _json(capsys, *dp, "--shard-optimizer")
    unsharded = _json(capsys, *dp)
    assert shard["shard_optimizer"] is True
    assert shard["gather_s"]["1f1b"] == [
        ring_allgather_s(sum(PARAMS[a:b]), 2, 1e9, 0.0) for a, b in BOUNDS
    ]
    assert unsharded["gather_s"]["1f1b"] == [0.0, 0.0]
    for k, (a, b) in enumerate(BOUNDS):
        state = sum(2 * p for p in PARAMS[a:b])
        got = unsharded["runs"]["1f1b"]["stages"][str(k)]["peak_memory_bytes"]
        assert got - shard["runs"]["1f1b"]["stages"][str(k)]["peak_memory_bytes"] == state // 2


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--recompute", "sometimes"], ["'sometimes'", "none, full, stages:0,1"]),
        (["--recompute", "units:attention"], ["'attention'", "by index 0..5"]),
        (["--shard-optimizer"], ["--shard-optimizer", "--data-parallel 2 or more"]),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, names) -> None:
    profile_path = tmp_path / "profile.json"
    _profile().save(profile_path)
    base = ["simulate", "--method", "1f1b", "--stages", "2", "--profile", str(profile_path)]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for name in names:
        assert name in err
