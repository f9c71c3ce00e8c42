"""``plan --memory-cap`` recomputes or shards when the cap binds, and says what it costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.partition import min_memory_partition
from pipeoptim.plan.partition_cost import evaluate_partition
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.planning import evaluate_candidate, per_unit_profile
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_method

MIB = 2**20
X = 64 * MIB


def _profile() -> Profile:
    """Expanding units (output 4X from input X) between contracting ones (X from 4X): the
    expanding ones free 3X each when recomputed."""
    acts = [4 * X if i % 2 == 0 else X for i in range(8)]
    return Profile.from_costs(
        forward_s=[0.01] * 8,
        backward_s=[0.02] * 8,
        activation_bytes=acts,
        param_bytes=[32 * MIB] * 8,
        names=[
            f"{'up' if i % 2 == 0 else 'down'}{i}:{'Up' if i % 2 == 0 else 'Down'}"
            for i in range(8)
        ],
        optimizer="adam",
        batch_size=32,
        meta={"input_shape": [32, X // 128], "input_dtype": "torch.float32"},
    )


def _peak_without() -> int:
    """The least any partition needs without recomputation (1f1b, P = 4, M = 4)."""
    unit = per_unit_profile(_profile(), 4)
    factors = method_memory_factors("1f1b", 4, 4)
    return min_memory_partition(unit, 4, memory_factors=factors).peak_memory_bytes


def test_partition_memory_with_recomputation_follows_the_formula() -> None:
    unit = per_unit_profile(_profile(), 4)
    bounds = [(0, 2), (2, 4), (4, 6), (6, 8)]
    sets = [frozenset({0}), frozenset(), frozenset({0, 1}), frozenset()]
    got = evaluate_partition(unit, bounds, recompute=sets, optimizer_shards=2)
    plain = evaluate_partition(unit, bounds)
    a = [x.activation_bytes for x in unit.layers]
    inputs = [32 * (X // 128) * 4 // 4, *a[:-1]]
    for k, (start, end) in enumerate(bounds):
        layers = unit.layers[start:end]
        # unrecomputed units keep their activations, a run of recomputed ones its first input
        kept = sum(
            a[start + i] if i not in sets[k] else inputs[start + i] if i - 1 not in sets[k] else 0
            for i in range(end - start)
        )
        weights = sum(x.param_bytes for x in layers)
        state = sum(-(-x.optimizer_state_bytes // 2) for x in layers)
        assert got.stage_memory[k] == 2 * weights + state + kept
        extra = sum(layers[i].forward_s for i in sets[k])
        assert got.stage_compute_s[k] == pytest.approx(plain.stage_compute_s[k] + extra)


def test_the_planner_recomputes_when_the_cap_binds_and_the_plan_fits() -> None:
    free = _peak_without()
    cap = free - 16 * MIB  # under what any partition needs without recomputation
    c = evaluate_candidate(_profile(), 4, "1f1b", 4, memory_cap_bytes=cap)
    assert c.partition is not None and c.infeasible is None
    assert any(c.recompute) and not c.shard_optimizer
    assert c.peak_memory_bytes <= cap < c.unfitted_memory_bytes
    # the throughput cost is the simulated slowdown against the same partition without it
    bounds = c.partition.boundaries
    shape = _shape()
    plain = CostModel.from_profile(_profile(), bounds, 4)
    with_rc = CostModel.from_profile(_profile(), bounds, 4, recompute=list(c.recompute))
    base = evaluate_method("1f1b", shape, plain).steady_throughput
    slower = evaluate_method("1f1b", shape, with_rc).steady_throughput
    assert c.unfitted_throughput == pytest.approx(base)
    assert c.throughput == pytest.approx(slower) and slower < base
    assert c.slowdown == pytest.approx(1 - slower / base)
    # fewest units: every recomputed unit is an expanding one (even global index)
    for units, (start, _) in zip(c.recompute, bounds, strict=True):
        assert all((start + i) % 2 == 0 for i in units)


def _shape():  # the planner's shape for 1f1b, P=4, M=4
    from pipeoptim.plan.methods import get_method

    return get_method("1f1b").shape(4, 4, None)


def test_no_recomputation_when_the_cap_does_not_bind() -> None:
    c = evaluate_candidate(_profile(), 4, "1f1b", 4, memory_cap_bytes=_peak_without() + MIB)
    assert not c.fitted and c.recompute_entries() is None


def _plan(tmp_path: Path, capsys, *argv: str) -> tuple[int, str, str]:
    path = tmp_path / "profile.json"
    _profile().save(path)
    code = main(["plan", "--profile", str(path), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_command_writes_the_choice_and_simulate_agrees(tmp_path, capsys) -> None:
    cap = _peak_without() - 16 * MIB
    out_path = tmp_path / "plan.json"
    argv = ["--stages", "4", "--method", "1f1b", "--micro-batches", "4"]
    code, out, err = _plan(
        tmp_path, capsys, *argv, "--memory-cap", str(cap), "--out", str(out_path)
    )
    assert code == 0, err
    assert "Memory: no partition fits" in out and "recompute activations" in out
    assert "% less throughput" in out
    plan = Plan.load(out_path)
    assert plan.recompute is not None and any(e != "none" for e in plan.recompute)
    fit = plan.notes["memory_fit"]
    assert fit["slowdown"] > 0 and fit["peak_memory_bytes_without"] > cap
    # the simulator, reading only the plan file, finds every stage within the cap
    assert main(["simulate", "--plan", str(out_path), "--json", "--engine", "fast"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]["1f1b"]
    assert max(st["peak_memory_bytes"] for st in runs["stages"].values()) <= cap
    assert runs["steady_throughput"] == pytest.approx(plan.notes["predicted_samples_per_s"])


def test_device_search_shards_where_there_are_replicas(tmp_path, capsys) -> None:
    out_path = tmp_path / "plan.json"
    argv = ["--devices", "8", "--method", "1f1b", "--bandwidth", "10GB/s"]
    code, out, err = _plan(
        tmp_path, capsys, *argv, "--memory-cap", "250MiB", "--out", str(out_path)
    )
    assert code == 0, err
    plan = Plan.load(out_path)
    assert plan.data_parallel >= 2 and plan.shard_optimizer
    assert "shard the optimizer state" in out


def test_nothing_fits_even_so_names_the_smallest_reach(tmp_path, capsys) -> None:
    argv = ["--stages", "4", "--method", "1f1b", "--micro-batches", "4", "--memory-cap", "300MiB"]
    code, _, err = _plan(tmp_path, capsys, *argv)
    assert code == 2
    line = err.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert "even recomputing activations" in line and "smallest possible peak" in line
    assert "raise --memory-cap to at least" in line
