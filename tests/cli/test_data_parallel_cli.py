"""``simulate --data-parallel`` and ``plan --devices`` end to end: the flags, what they
print and write, the plan round trip, and a clear error for every bad value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile

MB = 10**6


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    fwd = [0.01 * (1 + i % 3) for i in range(8)]
    Profile.from_costs(
        fwd, [2 * f for f in fwd], [2 * MB] * 8, [4 * MB] * 8, batch_size=32, optimizer="adam"
    ).save(path)
    return path


# --------------------------------------------------------------------------- simulate
EXACT = [
    "simulate", "--stages", "2", "--method", "gpipe", "--micro-batches", "2",
    "--mini-batches", "3", "--uniform", "1,2,0.5", "--param-bytes", "1GiB",
    "--activation-bytes", "0", "--gpus-per-node", "2", "--inter-node-bandwidth", "1GiB/s",
    "--inter-node-latency", "0.125",
]  # fmt: skip


def test_simulate_adds_the_all_reduce_to_every_update(capsys) -> None:
    one = _json(capsys, *EXACT)["runs"]["gpipe"]
    data = _json(capsys, *EXACT, "--data-parallel", "2")
    two = data["runs"]["gpipe"]
    # 2 replicas, 2^30 bytes over 2^30 B/s and 1/8 s: 2/8 + 1 = 1.25 s per update
    assert data["data_parallel"] == 2 and data["allreduce_s"]["gpipe"] == [1.25, 1.25]
    assert one["span_s"] == 3 * 9.5
    assert two["span_s"] == 3 * (9.5 + 1.25)
    assert two["samples"] == 2 * one["samples"]  # global: both replicas
    # a rate (rounded) by hand, against the simulator's window over the updates
    assert two["steady_throughput"] == pytest.approx(2 * 2 / (9.5 + 1.25), rel=1e-12)


def test_simulate_prints_the_replicas_and_the_all_reduce(capsys) -> None:
    assert main([*EXACT, "--data-parallel", "2", "--method", "gpipe,pipeoptim"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[:4] == ["method", "P", "D", "M"]
    lines = [line for line in out.splitlines() if line.startswith("all-reduce")]
    assert lines == [
        "all-reduce per update over D=2 replicas (ring): stages 0-1 1.25 s "
        "(between nodes, 1.07 GB/s)"
    ]
    assert main(EXACT) == 0  # one replica: no D column, no all-reduce line
    out = capsys.readouterr().out
    assert " D " not in out.splitlines()[0] and "all-reduce" not in out


def test_simulate_profile_splits_the_batch_among_replicas(capsys, profile: Path) -> None:
    base = ["simulate", "--profile", str(profile), "--stages", "2", "--method", "1f1b"]
    one = _json(capsys, *base, "--batch-size", "16")["runs"]["1f1b"]
    two = _json(capsys, *base, "--batch-size", "32", "--data-parallel", "2")["runs"]["1f1b"]
    # each replica trains 16 of the 32 samples, as the single pipeline did; the all-reduce
    # is free (no links given), so twice the samples in the same time
    assert two["span_s"] == pytest.approx(one["span_s"], rel=1e-12)
    assert two["throughput"] == pytest.approx(2 * one["throughput"], rel=1e-12)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data-parallel", "0"], "--data-parallel must be a whole number of pipeline replicas"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be a whole number of devices >= 1"),
        (["--inter-node-bandwidth", "25GB/s"], "needs --gpus-per-node G, which says"),
        (["--inter-node-latency", "0.001"], "needs --gpus-per-node G, which says"),
        (["--gpus-per-node", "8", "--inter-node-latency", "-1"], "--inter-node-latency must be"),
        (["--gpus-per-node", "8", "--inter-node-bandwidth", "fast"], "bandwidth"),
        (
            ["--data-parallel", "3", "--gpus-per-node", "8"],
            "12 devices on nodes of 8 GPUs leave the last node part-used",
        ),
    ],
)
def test_simulate_refuses_bad_cluster_flags(capsys, extra: list[str], message: str) -> None:
    assert message in _error(capsys, "simulate", "--stages", "4", *extra)


def test_simulate_refuses_a_batch_the_replicas_cannot_split(capsys, profile: Path) -> None:
    err = _error(
        capsys, "simulate", "--profile", str(profile), "--stages", "2", "--method", "gpipe",
        "--micro-batches", "4", "--data-parallel", "3",
    )  # fmt: skip
    assert "batch size 32 is not divisible by 3 replicas x 4 micro-batches" in err
    assert "use a batch size of 24, or fewer replicas or micro-batches" in err
    # several methods: the ones that cannot split it are skipped with the reason
    data = _json(
        capsys, "simulate", "--profile", str(profile), "--stages", "2",
        "--micro-batches", "4", "--data-parallel", "4", "--method", "gpipe,pipedream",
        "--batch-size", "8",
    )  # fmt: skip
    assert [s["method"] for s in data["skipped"]] == ["gpipe"]
    assert "is not divisible by 4 replicas x 4" in data["skipped"][0]["reason"]


# --------------------------------------------------------------------------- plan
def test_plan_devices_writes_a_pp_x_dp_plan_that_simulate_reproduces(
    capsys, profile: Path, tmp_path: Path
) -> None:
    out = tmp_path / "plan.json"
    argv = [
        "plan", "--profile", str(profile), "--devices", "8", "--gpus-per-node", "4",
        "--bandwidth", "100GB/s", "--inter-node-bandwidth", "1GB/s",
        "--inter-node-latency", "0.00001", "--global-batch", "64", "--method", "gpipe",
        "--out", str(out),
    ]  # fmt: skip
    data = _json(capsys, *argv)
    plan = Plan.load(out)
    assert plan.num_stages * plan.data_parallel == 8
    assert plan.batch_size == 64 and plan.method == "gpipe"
    notes = plan.notes
    assert notes["gpus_per_node"] == 4 and notes["devices"] == 8
    assert notes["inter_node_bandwidth_bytes_per_s"] == 1e9
    assert notes["inter_node_latency_s"] == 1e-5 and notes["bandwidth_bytes_per_s"] == 1e11
    assert data["why"].startswith(f"Run {plan.num_stages} pipeline stage(s) x ")
    labels = [(f["stages"], f["data_parallel"]) for f in data["factorisations"]]
    assert sorted(labels) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    # simulating the plan file (replicas, tiers and batch from the plan) gives the promise
    run = _json(capsys, "simulate", "--plan", str(out))
    assert run["data_parallel"] == plan.data_parallel
    got = run["runs"]["gpipe"]["steady_throughput"]
    assert got == pytest.approx(notes["predicted_samples_per_s"], rel=1e-9)


def test_plan_devices_prints_the_factorisations_and_why(capsys, profile: Path) -> None:
    argv = ["plan", "--profile", str(profile), "--devices", "16", "--global-batch", "64"]
    assert main([*argv, "--gpus-per-node", "4"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "note: --gpus-per-node without --inter-node-bandwidth" in captured.err
    assert "evaluating P=1 x D=16" in captured.err  # progress
    table = out.split("\n\n")[1].splitlines()
    assert table[0].split()[:4] == ["P", "D", "method", "M"]
    assert sum(" best " in row for row in table[2:]) == 1
    assert "more stages than the profile's 8 layers" in out  # P=16
    assert "Against the other factorisations:" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--devices", "0"], "--devices must be a whole number >= 1 (got 0)"),
        (["--devices", "4", "--global-batch", "0"], "--global-batch must be a whole number"),
        (["--devices", "12", "--gpus-per-node", "8"], "12 devices on nodes of 8 GPUs"),
        (["--stages", "3", "--gpus-per-node", "2"], "3 devices on nodes of 2 GPUs"),
        (["--devices", "4", "--gpus-per-node", "0"], "--gpus-per-node must be a whole number"),
        (["--devices", "4", "--inter-node-bandwidth", "1GB/s"], "needs --gpus-per-node G"),
        (
            ["--devices", "4", "--gpus-per-node", "2", "--inter-node-latency", "-1"],
            "--inter-node-latency must be a number >= 0",
        ),
        (
            ["--devices", "4", "--method", "interleaved-1f1b"],
            "plan it with --stages P (e.g. --stages 4 --method interleaved-1f1b)",
        ),
        (
            ["--devices", "4", "--global-batch", "2", "--method", "gpipe"],
            "no factorisation of 4 devices into P stages x D replicas can run",
        ),
    ],
)
def test_plan_refuses_bad_device_flags(capsys, profile: Path, extra, message) -> None:
    assert message in _error(capsys, "plan", "--profile", str(profile), *extra)


def test_plan_takes_stages_or_devices_not_both(capsys, profile: Path) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(profile), "--stages", "2", "--devices", "4"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(profile)])
    assert "one of the arguments --stages --devices is required" in capsys.readouterr().err


def test_plan_stages_keeps_one_replica_and_records_the_tiers(capsys, profile: Path) -> None:
    data = _json(
        capsys, "plan", "--profile", str(profile), "--stages", "4", "--gpus-per-node", "2",
        "--inter-node-bandwidth", "1GB/s", "--method", "pipeoptim",
    )  # fmt: skip
    plan = data["plan"]
    assert plan["num_stages"] == 4 and plan["data_parallel"] == 1
    assert plan["notes"]["gpus_per_node"] == 2
    assert plan["notes"]["inter_node_bandwidth_bytes_per_s"] == 1e9


def test_flags_override_the_plans_cluster_one_by_one() -> None:
    import argparse

    from pipeoptim.commands.cluster import cluster_from_args, cluster_notes
    from pipeoptim.sim.collectives import Cluster

    notes = cluster_notes(Cluster(1e11, 1e-6, 8, 1e9, 1e-4))
    assert notes == {
        "bandwidth_bytes_per_s": 1e11,
        "latency_s": 1e-6,
        "gpus_per_node": 8,
        "inter_node_bandwidth_bytes_per_s": 1e9,
        "inter_node_latency_s": 1e-4,
    }

    def flags(**given: object) -> argparse.Namespace:
        names = ("gpus_per_node", "inter_node_bandwidth", "inter_node_latency")
        return argparse.Namespace(**{n: given.get(n) for n in names})

    assert cluster_from_args(flags(), 1e11, 1e-6, notes) == Cluster(1e11, 1e-6, 8, 1e9, 1e-4)
    moved = cluster_from_args(flags(gpus_per_node=4), 1e11, 1e-6, notes)
    assert moved == Cluster(1e11, 1e-6, 4, 1e9, 1e-4)  # the plan's tiers, other nodes
    faster = cluster_from_args(flags(inter_node_bandwidth="inf"), 1e11, 1e-6, notes)
    assert faster.inter_bandwidth == float("inf") and faster.inter_latency_s == 1e-4
    free = cluster_notes(Cluster())
    assert free == {"bandwidth_bytes_per_s": None, "latency_s": 0.0}
