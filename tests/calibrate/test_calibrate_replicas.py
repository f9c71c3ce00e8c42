"""`pipeoptim calibrate` of a data-parallel run (D replicas x P stages).

A simulated D = 2 run whose costs and all-reduce are known, dressed as a runtime trace, is
calibrated back exactly: micro-batches of B/(D·M) samples, the measured update split into
the modelled ring all-reduce and the optimizer step, the same method predicted as itself,
and another D predicted as the simulator runs it. A real 2 x 2 gloo run is calibrated the
same way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeoptim.calibrate import calibrate, calibrated_profile, costs_from_trace, what_if
from pipeoptim.cli import main
from pipeoptim.commands.cluster import cluster_notes
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.sim.collectives import Cluster, allreduce_times, ring_allreduce_s
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.trace import Trace

SAMPLES = 8  # per micro-batch of one replica
CLUSTER = Cluster(bandwidth=2e8, latency_s=2e-4)  # a slow link: the all-reduce shows


def replica_costs(stages: int) -> CostModel:
    """One replica's costs (stages unlike each other)."""
    base = CostModel.uniform(
        stages,
        0.010,
        0.020,
        0.002,
        predict_s=0.003,
        param_bytes=400_000,
        activation_bytes=1024,
        samples_per_micro_batch=SAMPLES,
    )
    return dataclasses.replace(
        base, forward_s=tuple(f * (1 + 0.25 * k) for k, f in enumerate(base.forward_s))
    )


def as_measured(method: str, stages: int, m: int, n: int, replicas: int) -> Trace:
    """The simulator's run of ``replicas`` replicas on CLUSTER, dressed as the runtime's: the
    global batch in the meta, the replicas in meta and plan, the cluster in the plan's
    notes (as `pipeoptim plan --devices` writes them)."""
    costs = replica_costs(stages)
    costs = dataclasses.replace(
        costs,
        data_parallel=replicas,
        allreduce_s=allreduce_times(costs.grad_bytes, replicas, CLUSTER, stages),
    )
    plan = Plan(
        method,
        stages,
        micro_batches=m,
        data_parallel=replicas,
        optimizer=OptimizerSpec("sgd", 0.1),
        notes=cluster_notes(CLUSTER),
    )
    trace = evaluate_trace(method, plan.shape(n), costs)
    # here, not at the top: the spawned ranks load this file as a model, without tests/
    from support.traces import add_receive_waits

    add_receive_waits(trace)
    trace.meta.update(
        source="runtime",
        plan=plan.to_dict(),
        batch_size=SAMPLES * m * replicas,  # the global batch
        mini_batches=n,
        transport="dist",
        boundaries=[[k, k + 1] for k in range(stages)],
        predict_s={"0": 0.003, "1": 0.003} if method == "pipeoptim" else {},
        data_parallel=replicas,
    )
    return trace


def per_batch(trace: Trace) -> float:
    return float(trace.meta["batch_size"]) / compute_metrics(trace).steady_throughput


def test_calibrate_reads_the_replicas_and_models_their_allreduce() -> None:
    run = as_measured("1f1b", 3, 4, 12, replicas=2)
    costs = costs_from_trace(run)
    # a micro-batch is B/(D·M) = 64/(2·4) samples, not B/M
    assert costs.samples_per_micro_batch == SAMPLES
    assert costs.data_parallel == 2
    # the measured update is split: the modelled ring all-reduce, and the optimizer step
    ring = ring_allreduce_s(400_000, 2, CLUSTER.bandwidth, CLUSTER.latency_s)
    assert ring > 0.001  # larger than the step itself: an all-reduce to miss
    assert costs.allreduce_s == pytest.approx((ring,) * 3)
    assert costs.update_s == pytest.approx((0.002,) * 3)
    predicted, rows = calibrate(run)
    assert predicted.meta["data_parallel"] == 2
    assert predicted.meta["allreduce_s"] == pytest.approx({str(k): ring for k in range(3)})
    by_name = {r.quantity: r for r in rows}
    for quantity in ("time per mini-batch (steady state)", "whole-run throughput", "bubble ratio"):
        assert abs(by_name[quantity].relative_error) < 1e-9, quantity
    # the calibrated profile is one replica's: its batch is B/D, its bytes for that batch,
    # its update times the optimizer step (simulate --data-parallel adds the all-reduce)
    profile = calibrated_profile(run)
    assert profile.batch_size == SAMPLES * 4
    assert [x.activation_bytes for x in profile.layers] == [1024 * 4] * 3
    assert [x.update_s for x in profile.layers] == pytest.approx([0.002] * 3)
    assert profile.meta["calibrated_from"]["data_parallel"] == 2
    # the same method, shape and D predicts as itself (not "2.05x as fast")
    same = what_if(run, "1f1b", micro_batches=4)
    assert same.data_parallel == 2
    assert same.trace.meta["allreduce_s"] == pytest.approx({str(k): ring for k in range(3)})
    measured = by_name["time per mini-batch (steady state)"].measured
    assert measured / same.time_per_mini_batch == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("method", ["1f1b", "pipeoptim"])
def test_predict_another_replica_count_as_the_simulator_runs_it(method: str) -> None:
    m = 4 if method == "1f1b" else 1
    run = as_measured(method, 2, m, 12, replicas=2)
    got = what_if(run, method, micro_batches=m if method == "1f1b" else None, data_parallel=4)
    # 4 replicas share the run's global batch of 2·M·8: each trains half a run replica's
    # micro-batch; times scale linearly (no offline profile), the update is the step plus
    # the ring over 4
    base = replica_costs(2)
    truth_costs = dataclasses.replace(
        base,
        forward_s=tuple(f / 2 for f in base.forward_s),
        backward_s=tuple(b / 2 for b in base.backward_s),
        activation_bytes=tuple(a // 2 for a in base.activation_bytes),
        send_forward_bytes=tuple(a // 2 for a in base.send_forward_bytes),
        send_backward_bytes=tuple(a // 2 for a in base.send_backward_bytes),
        samples_per_micro_batch=SAMPLES / 2,
        predict_s=base.predict_s if method == "pipeoptim" else base.update_s,
        data_parallel=4,
        allreduce_s=allreduce_times(base.grad_bytes, 4, CLUSTER, 2),
    )
    truth = evaluate_trace(method, get_method(method).shape(2, m, 12), truth_costs)
    assert got.data_parallel == 4
    assert got.time_per_mini_batch == pytest.approx(per_batch(truth), rel=1e-9)
    assert got.trace.meta["allreduce_s"]["0"] == pytest.approx(
        ring_allreduce_s(400_000, 4, CLUSTER.bandwidth, CLUSTER.latency_s)
    )
    assert got.trace.meta["batch_size"] == SAMPLES * m * 2  # the global batch, unchanged


def test_cli_predicts_another_replica_count_and_refuses_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.json"
    as_measured("1f1b", 2, 4, 8, replicas=2).save(path)
    base = ["calibrate", "--trace", str(path)]
    assert main([*base, "--predict", "1f1b", "--micro-batches", "4"]) == 0
    out = capsys.readouterr().out
    assert "modelled all-reduce per update over D=2 replicas (ring)" in out
    assert "1.00x as fast" in out  # the run's own method, shape and D
    argv = [*base, "--predict", "1f1b", "--micro-batches", "4", "--predict-data-parallel", "4"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["data_parallel"] == 2 and set(data["allreduce_s"]) == {"0", "1"}
    assert data["what_if"][0]["data_parallel"] == 4 and data["what_if"][0]["allreduce_s"]
    # 64 samples do not split into 3 replicas x 4 micro-batches
    argv = [*base, "--predict", "1f1b", "--micro-batches", "4", "--predict-data-parallel", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "batch size 64 is not divisible by 3 replicas x 4 micro-batches" in err
    assert "Traceback" not in err
    assert main([*base, "--predict-data-parallel", "4"]) == 2
    assert "add --predict METHOD" in capsys.readouterr().err
    assert main([*base, "--predict", "1f1b", "--predict-data-parallel", "0"]) == 2
    assert "--predict-data-parallel must be at least 1 (got 0)" in capsys.readouterr().err
    # a slower cluster than the run had: the modelled all-reduce exceeds the update
    assert main([*base, "--bandwidth", "1MB/s"]) == 0
    assert "is longer than its whole measured update" in capsys.readouterr().out


def net() -> list[nn.Module]:
    """A model where compute, not messaging latency, fills most of each action."""
    return [nn.Linear(128, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 4)]


def dataset() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 128, generator=g)
    y = torch.randint(0, 4, (2048,), generator=g)
    return x[:-256], y[:-256], x[-256:], y[-256:]


@pytest.mark.slow
def test_a_real_two_by_two_gloo_run_is_calibrated_per_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 replicas x 2 stages on gloo (4 processes), through `pipeoptim train`."""
    trace_path, profile_path = tmp_path / "run.json", tmp_path / "calibrated.json"
    argv = ["train", "--method", "pipeoptim", "--stages", "2", "--transport", "dist"]
    argv += ["--data-parallel", "2", "--model", f"{Path(__file__).resolve()}:net"]
    argv += ["--batch-size", "64", "--max-steps", "24", "--quiet", "--timeout", "60"]
    assert main([*argv, "--trace", str(trace_path)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    measured = Trace.load(trace_path)
    assert measured.meta["data_parallel"] == 2
    costs = costs_from_trace(measured)
    assert costs.samples_per_micro_batch == 32  # B/(D·M) = 64/(2·1)
    assert costs.activation_bytes[0] > 0
    predicted, rows = calibrate(measured)
    assert predicted.meta["data_parallel"] == 2
    assert all(v > 0 for v in predicted.meta["allreduce_s"].values())  # modelled
    # the measured update is the optimizer step plus the modelled all-reduce
    updates = [e.duration for e in measured.events if e.kind == "U" and e.stage == 0]
    assert costs.update_s[0] + costs.allreduce_s[0] == pytest.approx(
        sorted(updates)[len(updates) // 2], rel=0.5
    )
    # the same method, shape and D predicts as calibrate predicts the run, and (loosely: 4
    # processes may share fewer cores) near what was measured, not 2x off
    same = what_if(measured, "pipeoptim")
    time_row = rows[0]
    assert same.time_per_mini_batch == pytest.approx(time_row.predicted, rel=0.02)
    assert 0.5 < time_row.measured / same.time_per_mini_batch < 2.0
    # the profile is one replica's mini-batch: 32 samples, with that batch's activations
    assert main(["calibrate", "--trace", str(trace_path), "--out-profile", str(profile_path)]) == 0
    profile = json.loads(profile_path.read_text())
    assert profile["batch_size"] == 32
    first, last = measured.meta["boundaries"][0]
    stage0 = sum(x["activation_bytes"] for x in profile["layers"][first:last])
    assert stage0 == max(costs.activation_bytes[0], costs.send_forward_bytes[0])
    assert "modelled all-reduce per update over D=2" in capsys.readouterr().out
