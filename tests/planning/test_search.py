"""Plan search ranks (method, M, partition) candidates by simulated throughput, then staleness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.errors import PlanError
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.planning import Candidate, evaluate_candidate, explain, rank, search


def uneven(num_layers: int = 12) -> Profile:
    fwd = [0.01 * (1 + (i % 4)) for i in range(num_layers)]
    return Profile.from_costs(
        fwd,
        [2 * f for f in fwd],
        [1_000_000] * num_layers,
        [4_000_000] * num_layers,
        batch_size=32,
    )


def test_ranking_prefers_fresh_weights_at_equal_speed() -> None:
    ranked = search(uneven(), 4)
    assert all(c.infeasible is None for c in ranked)
    effective = [c.effective_throughput for c in ranked]
    assert effective[0] == pytest.approx(max(effective), rel=0.011)
    # zb-h1: 97% of the asynchronous methods' speed, on fresh weights (no risk term)
    assert ranked[0].method == "zb-h1" and ranked[0].uncorrected == 0
    names = [c.method for c in ranked]
    # same schedule, same speed: PipeOptim (staleness 0) before PipeDream (staleness P-1)
    assert names.index("pipeoptim") < names.index("pipedream")
    po = next(c for c in ranked if c.method == "pipeoptim")
    pd = next(c for c in ranked if c.method == "pipedream")
    assert po.throughput == pytest.approx(pd.throughput)
    assert (po.max_staleness, pd.max_staleness) == (0, 3)
    assert po.peak_memory_bytes < pd.peak_memory_bytes  # 2 weight copies instead of P-k


def test_a_correction_that_keeps_a_buffer_is_planned_with_its_memory() -> None:
    """The extrapolation keeps one weight-sized buffer: the search charges it as one more
    weight copy (not its base's evaluation, whose memory it does not have) and ranks the
    base first at the same speed and risk."""
    ranked = search(uneven(), 4, methods=["2bw", "2bw+extrapolate"])
    by = {(c.method, c.micro_batches): c for c in ranked}
    base, extra = by[("2bw", 4)], by[("2bw+extrapolate", 4)]
    assert extra.throughput == pytest.approx(base.throughput)
    assert extra.peak_memory_bytes > base.peak_memory_bytes
    assert [c.method for c in ranked].index("2bw") < [c.method for c in ranked].index(
        "2bw+extrapolate"
    )


def test_async_beats_flushed_with_few_micro_batches() -> None:
    po = evaluate_candidate(uneven(), 4, "pipeoptim", 1, mini_batches=64)
    gp = evaluate_candidate(uneven(), 4, "gpipe", 4, mini_batches=64)
    assert po.throughput > gp.throughput
    assert po.bubble_ratio < gp.bubble_ratio


def test_memory_cap_rules_methods_out_and_explains() -> None:
    from pipeoptim.plan.memory_factors import method_memory_factors
    from pipeoptim.plan.methods import get_method
    from pipeoptim.plan.partition import min_memory_partition
    from pipeoptim.planning import per_unit_profile
    from pipeoptim.planning.memory_fit import smallest_reach

    least = {
        "pipeoptim": min_memory_partition(
            uneven(), 4, memory_factors=method_memory_factors("pipeoptim", 4, 1)
        ).peak_memory_bytes,
        # recomputing a whole stage keeps one input, so pipedream is out only below this
        "pipedream": smallest_reach(
            per_unit_profile(uneven(), 1), get_method("pipedream"), 4, 1, 1
        ),
    }
    assert least["pipeoptim"] < least["pipedream"]
    cap = (least["pipedream"] + least["pipeoptim"]) // 2
    ranked = search(uneven(), 4, methods=["pipedream", "pipeoptim"], memory_cap_bytes=cap)
    # pipeoptim's dial (M = 1, 2, 4) fits: more micro-batches hold fewer activations
    assert [c.method for c in ranked] == ["pipeoptim"] * 3 + ["pipedream"]
    assert ranked[-1].infeasible is not None and "raise --memory-cap" in ranked[-1].infeasible
    text = explain(ranked, cap)
    assert text.startswith(f"Run pipeoptim with {ranked[0].micro_batches} micro-batch(es)")
    assert "Over the memory cap: pipedream." in text


def test_nothing_fits() -> None:
    ranked = search(uneven(), 4, methods=["gpipe"], memory_cap_bytes=1000)
    with pytest.raises(PlanError, match="smallest possible peak"):
        explain(ranked, 1000)


def test_more_stages_than_layers() -> None:
    with pytest.raises(PlanError, match="cannot split 12 layers into 13 stages"):
        search(uneven(), 13)


def test_rank_orders_by_speed_bucket_then_staleness_then_memory() -> None:
    def cand(name: str, speed: float, stale: int) -> Candidate:
        return Candidate(name, 1, None, throughput=speed, max_staleness=stale)

    ranked = rank([cand("a", 100.0, 3), cand("b", 99.5, 0), cand("c", 120.0, 5)])
    assert [c.method for c in ranked] == ["c", "b", "a"]


def test_an_exact_tie_goes_to_the_optimizers_own_prediction_rule() -> None:
    """Under SGD SpecTrain's momentum is PipeOptim's Δ: the two tie in every column, and the
    rule that follows any optimizer's update ranks first, whatever the input order."""
    tied = [Candidate(m, 1, None, throughput=100.0) for m in ("spectrain", "pipeoptim")]
    assert [c.method for c in rank(tied)] == ["pipeoptim", "spectrain"]
    assert [c.method for c in rank(tied[::-1])] == ["pipeoptim", "spectrain"]
    # in the same 1% bucket but faster: throughput decides before the rule
    faster = [Candidate("spectrain", 1, None, throughput=100.5), tied[1]]
    assert [c.method for c in rank(faster)] == ["spectrain", "pipeoptim"]
    names = [c.method for c in search(uneven(), 4)]
    assert names.index("pipeoptim") < names.index("spectrain")


def test_plan_cli_writes_a_plan_that_simulate_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = tmp_path / "profile.json"
    uneven().save(prof)
    out, html = tmp_path / "plan.json", tmp_path / "plan.html"
    code = main(
        [
            "plan",
            "--profile",
            str(prof),
            "--stages",
            "3",
            "--method",
            "pipeoptim",
            "--bandwidth",
            "10GB/s",
            "--out",
            str(out),
            "--html",
            str(html),
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    plan = Plan.load(out)
    assert plan.method == "pipeoptim" and plan.num_stages == 3
    assert plan.boundaries is not None and plan.boundaries[-1][1] == 12
    assert data["ranking"][0]["samples_per_s"] > 0
    # simulate --plan predicts exactly what the plan promised (same costs, same engine)
    argv = ["simulate", "--plan", str(out), "--bandwidth", "10GB/s", "--engine", "fast"]
    assert main([*argv, "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["runs"]["pipeoptim"]
    assert sim["steady_throughput"] == pytest.approx(plan.notes["predicted_samples_per_s"])
    assert '<script src="http' not in html.read_text()
    code = main(["simulate", "--plan", str(out), "--json"])
    sim = json.loads(capsys.readouterr().out)
    assert code == 0
    assert json.dumps(sim).count("pipeoptim") >= 1


def test_plan_cli_infeasible_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "profile.json"
    uneven().save(prof)
    code = main(
        [
            "plan",
            "--profile",
            str(prof),
            "--stages",
            "4",
            "--method",
            "gpipe",
            "--memory-cap",
            "1MiB",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "raise --memory-cap to at least" in err


def test_micro_batch_counts_divide_the_batch() -> None:
    from pipeoptim.planning import micro_batch_options

    assert micro_batch_options("1f1b", 4, 64) == [4, 8, 16]
    assert micro_batch_options("1f1b", 3, 32) == [4, 8, 16]  # 3, 6, 12 leave a remainder
    assert micro_batch_options("1f1b", 3, 48) == [3, 6, 12]
    assert micro_batch_options("gpipe", 4, 2) == []  # fewer samples than stages
    assert micro_batch_options("pipeoptim", 3, 32) == [1, 2]  # the dial: 3 leaves a remainder
    assert micro_batch_options("pipedream", 3, 32) == [1]
    profile = Profile.uniform(6, 0.01, 0.02, activation_bytes=100, param_bytes=1000, batch_size=32)
    ranked = search(profile, 3)
    assert all(32 % c.micro_batches == 0 for c in ranked)
    assert {c.micro_batches for c in ranked if c.method == "1f1b"} == {4, 8, 16}


def test_a_plan_of_the_builtin_mlp_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """plan --model with 3 stages and the default batch, then train --plan: every micro-batch
    count the planner may pick divides the batch, so the plan runs."""
    plan = tmp_path / "plan.json"
    assert (
        main(["plan", "--model", "mlp", "--stages", "3", "--batch-size", "32", "--out", str(plan)])
        == 0
    )
    capsys.readouterr()
    chosen = Plan.load(plan)
    assert 32 % chosen.micro_batches == 0
    assert main(["train", "--plan", str(plan), "--max-steps", "4", "--quiet"]) == 0


def test_simulate_plan_keeps_the_links_it_was_planned_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan made for slow links predicts the same run when simulated from the file."""
    profile, plan = tmp_path / "p.json", tmp_path / "plan.json"
    Profile.uniform(8, 0.01, 0.02, activation_bytes=10**6, param_bytes=1000, batch_size=8).save(
        profile
    )
    argv = ["plan", "--profile", str(profile), "--stages", "4", "--method", "pipeoptim"]
    argv += ["--bandwidth", "1GB/s", "--latency", "0.002", "--out", str(plan), "--json"]
    assert main(argv) == 0
    promised = json.loads(capsys.readouterr().out)["plan"]["notes"]
    assert main(["simulate", "--plan", str(plan), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"]["pipeoptim"]
    assert run["steady_throughput"] == pytest.approx(promised["predicted_samples_per_s"])
    assert (
        main(["simulate", "--plan", str(plan), "--bandwidth", "inf", "--latency", "0", "--json"])
        == 0
    )
    free = json.loads(capsys.readouterr().out)["runs"]["pipeoptim"]
    assert free["steady_throughput"] > run["steady_throughput"]  # the links cost something


def test_bounded_delay_methods_are_ranked_only_when_named() -> None:
    """Their cost (fewer updates on the early stages) is outside the risk model, so the
    default search leaves them out; named, they are simulated and ranked like any other."""
    default = {c.method for c in search(uneven(), 4)}
    assert "pipeoptim" in default
    assert not default & {"pipedream+bounded", "pipeoptim+bounded"}
    named = search(uneven(), 4, methods=["pipeoptim", "pipeoptim+bounded"])
    bounded = next(c for c in named if c.method == "pipeoptim+bounded")
    assert bounded.risk is not None and bounded.risk.distances == (1, 1, 1, 0)
