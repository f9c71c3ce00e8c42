"""The convergence-risk term: uncorrected distance per weight policy, its fit, its use in
the planner, and its constants against the committed study."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.plan import risk
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.risk import (
    RiskFitPoint,
    closure,
    closure_from_rows,
    fit_risk,
    method_risk,
    schedule_versions,
    uncorrected_distance,
)
from pipeoptim.planning import explain, search

STUDY = Path(__file__).resolve().parents[2] / "examples" / "convergence" / "results"


def test_uncorrected_distance_per_policy() -> None:
    assert uncorrected_distance("gpipe", "adam", 0, 0) == 0.0
    assert uncorrected_distance("pipedream", "adam", 3, 3) == 3.0
    assert uncorrected_distance("2bw", "adam", 1, 1) == 1.0
    assert uncorrected_distance("pipeoptim", "adam", 4, 0, closed=0.25) == 3.0
    # a prediction that moves away from the backward's weights is worse than none
    assert uncorrected_distance("spectrain", "adam", 4, 0, closed=-0.5) == 6.0
    assert uncorrected_distance("pipeoptim", "adam", 4, 0, closed=1.2) == 0.0


def test_schedule_versions_are_derived_from_the_schedule() -> None:
    assert schedule_versions("pipeoptim", 4) == ((3, 2, 1, 0), (0, 0, 0, 0))
    assert schedule_versions("pipedream", 4) == ((3, 2, 1, 0), (3, 2, 1, 0))
    assert schedule_versions("2bw", 4) == ((1, 1, 1, 0), (1, 1, 1, 1))
    assert schedule_versions("1f1b", 4) == ((0, 0, 0, 0), (0, 0, 0, 0))


def test_closure_lookup_uses_the_last_measured_distance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(risk, "CLOSURE", {("optimizer", "adam"): {1: 0.6, 3: 0.5}})
    assert closure("optimizer", "adam", 1) == 0.6
    assert closure("optimizer", "adam", 2) == 0.6  # between measured values: the one below
    assert closure("optimizer", "adam", 7) == 0.5
    assert closure("optimizer", "sgd", 3) == 0.0  # unmeasured: closes nothing
    assert closure("optimizer", "adam", 0) == 0.0


def test_method_risk_reads_the_worst_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(risk, "CLOSURE", {("optimizer", "adam"): {1: 0.8, 2: 0.5, 3: 0.4}})
    r = method_risk("pipeoptim", "adam", (3, 2, 1, 0), (0, 0, 0, 0), kappa={"adam": 0.2})
    assert r.uncorrected == pytest.approx(3 * 0.6)
    assert r.closed == 0.4
    assert r.risk == pytest.approx(0.2 * 1.8)
    sync = method_risk("gpipe", "adam", (0, 0), (0, 0), kappa={"adam": 0.2})
    assert (sync.risk, sync.closed) == (0.0, None)


def test_fit_recovers_kappa_through_the_origin() -> None:
    points = [
        RiskFitPoint("m", "pipeoptim", "adam", 8, e, 0.3 * e) for e in (0.5, 1.0, 2.0, 4.0)
    ] + [RiskFitPoint("m", "gpipe", "adam", 8, 0.0, 0.05)]  # e = 0 carries no slope
    points += [RiskFitPoint("m", "pipedream", "sgd", 4, 3.0, -0.2)]
    fit = fit_risk(points)
    assert fit["adam"][0] == pytest.approx(0.3)
    assert fit["adam"][1] == 4
    assert fit["sgd"] == (0.0, 1)  # faster than synchronous: no negative risk


def uniform_profile() -> Profile:
    return Profile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1000, batch_size=32)


def test_planner_passes_over_a_faster_method_with_high_risk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(risk, "RISK_CURVE", {})  # the straight line: κ decides
    monkeypatch.setattr(risk, "KAPPA", {"sgd": 0.0})
    fast = search(uniform_profile(), 8, methods=["gpipe", "pipeoptim"], optimizer="sgd")
    assert fast[0].method == "pipeoptim"  # no risk: the fastest wins
    assert "not chosen" not in explain(fast)

    monkeypatch.setattr(risk, "KAPPA", {"sgd": 1.0})
    ranked = search(uniform_profile(), 8, methods=["gpipe", "pipeoptim"], optimizer="sgd")
    assert ranked[0].method == "gpipe"
    # pipeoptim's dial: each M with the delay of its own schedule; the best-ranked is named
    dial = [c for c in ranked if c.method == "pipeoptim"]
    assert [c.micro_batches for c in dial] == [8, 4, 2, 1]  # a shorter delay, less risk
    whole = dial[-1]
    assert whole.risk is not None and whole.risk.distances == (7, 6, 5, 4, 3, 2, 1, 0)
    po = dial[0]
    assert po.throughput > ranked[0].throughput
    assert po.risk is not None and po.risk.distances == schedule_versions("pipeoptim", 8, 8)[0]
    text = explain(ranked)
    assert "pipeoptim is up to" in text and "faster per sample but not chosen" in text
    assert f"s = {max(po.risk.distances)} updates ahead" in text
    assert f"+{100 * po.risk.risk:.0f}% samples" in text


def test_constants_are_the_committed_study_fit() -> None:
    """KAPPA and CLOSURE are copied from the study's risk_fit.json: rerunning the study
    and forgetting to update them (or editing them by hand) fails here."""
    fit = json.loads((STUDY / "risk_fit.json").read_text())
    assert pytest.approx(fit["kappa"], abs=5e-4) == risk.KAPPA
    table = closure_from_rows(fit["closure"])
    assert set(risk.CLOSURE) == set(table)
    for key, by_s in table.items():
        assert risk.CLOSURE[key] == pytest.approx(by_s, abs=0.005), key
    assert pytest.approx(fit["correction_gain"], abs=0.005) == risk.CORRECTION_GAIN
    excess = {int(p): rows for p, rows in fit["depth_excess"].items()}
    assert set(risk.DEPTH_EXCESS) == set(excess)
    for p, rows in excess.items():
        assert risk.DEPTH_EXCESS[p] == pytest.approx(rows, abs=5e-4), p
    assert {int(p): rows for p, rows in fit["depth_copies"].items()} == risk.DEPTH_COPIES
    first = {int(p): rows for p, rows in fit["depth_excess_first"].items()}
    assert set(risk.DEPTH_EXCESS_FIRST) == set(first)
    for p, rows in first.items():
        assert risk.DEPTH_EXCESS_FIRST[p] == pytest.approx(rows, abs=5e-4), p


def test_plan_command_prints_s_per_stage_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """8 stages: the table shows s next to the staleness, and the recommendation says why
    the faster asynchronous methods lose (with the committed study's constants)."""
    from pipeoptim.cli import main

    path = tmp_path / "profile.json"
    uniform_profile().save(path)
    assert main(["plan", "--profile", str(path), "--stages", "8", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "s per stage" in out and "staleness" in out
    po = next(line for line in out.splitlines() if line.split()[:2] == ["pipeoptim", "1"])
    assert "7,6,5,4,3,2,1,0" in po  # whole mini-batches; the dial's other M are shorter
    po8 = next(line for line in out.splitlines() if line.split()[:2] == ["pipeoptim", "8"])
    assert "1x7,0" in po8
    pd = next(line for line in out.splitlines() if line.startswith("pipedream "))
    assert " 7 " in pd  # pipedream: staleness 7 with the same s
    assert "per sample but not chosen" in out
    assert "s = 7 updates ahead" in out


def test_simulate_prints_s_per_stage_and_risk(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeoptim.cli import main

    assert (
        main(["simulate", "--stages", "4", "--method", "gpipe,pipeoptim", "--optimizer", "adam"])
        == 0
    )
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[2:] if line.strip()}
    expected = method_risk("pipeoptim", "adam", *schedule_versions("pipeoptim", 4))
    assert "3,2,1,0" in rows["pipeoptim"]
    assert f"+{100 * expected.risk:.0f}%" in rows["pipeoptim"]
    assert " 0 " in rows["gpipe"] and "+0%" in rows["gpipe"]


def test_plan_for_8_stages_of_the_digits_mlp(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The issue's case: the digits MLP at 8 stages, SGD-momentum, planned as text and as
    JSON from a profile taken here for 2 ranks (a core each on CI's 2 cores: the message
    probe runs, not the layout probe, which tests/workloads/test_layout_probe.py runs; a
    4-rank profile took 1.6 times as long and plans the same way)."""
    from pipeoptim.cli import main

    profile = str(tmp_path / "mlp.json")
    assert (
        main(["profile", "--model", "mlp", "--ranks", "2", "--optimizer", "sgd", "--out", profile])
        == 0
    )
    capsys.readouterr()
    assert main(["plan", "--profile", profile, "--stages", "8", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line for line in out.splitlines() if line[:1].isalpha()}
    assert "7,6,5,4,3,2,1,0" in rows[("pipeoptim", "1")]
    why = out.strip().splitlines()[-1]
    assert why.startswith("Run ") and "weight staleness" in why

    assert (
        main(["plan", "--profile", profile, "--stages", "8", "--optimizer", "sgd", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    ranking = [r for r in data["ranking"] if r["infeasible"] is None]
    po = next(r for r in ranking if r["method"] == "pipeoptim" and r["micro_batches"] == 1)
    assert po["prediction_distance"] == [7, 6, 5, 4, 3, 2, 1, 0]
    assert po["convergence_risk"] > 0 and po["effective_samples_per_s"] < po["samples_per_s"]
    winner = ranking[0]
    top = max(r["effective_samples_per_s"] for r in ranking)
    assert winner["effective_samples_per_s"] >= 0.99 * top  # within the tie tolerance
    passed_over = [
        r
        for r in ranking
        if r["method"] != winner["method"]
        and r["samples_per_s"] >= 0.99 * winner["samples_per_s"]
        and r["effective_samples_per_s"] < 0.99 * winner["effective_samples_per_s"]
    ]
    assert ("not chosen" in data["why"]) == bool(passed_over)


def test_a_corrections_gain_shrinks_its_bases_distance_and_ranks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A measured gain g makes a corrected method's e its base's times 1 − g; unmeasured,
    it is level with its base (and the base, registered first, ranks first)."""
    base = risk.uncorrected_distance("pipedream", "adamw", 7, 7)
    assert risk.uncorrected_distance("pipedream+pipemare", "sgd", 7, 7) == base
    monkeypatch.setitem(risk.CORRECTION_GAIN, "pipemare-lr/adamw", 0.25)
    assert risk.uncorrected_distance("pipedream+pipemare", "adamw", 7, 7) == 0.75 * base
    monkeypatch.setitem(risk.CORRECTION_GAIN, "pipemare-lr/adamw", -0.5)
    assert risk.uncorrected_distance("pipedream+pipemare", "adamw", 7, 7) == 1.5 * base
    predicted = risk.uncorrected_distance("pipeoptim", "adamw", 7, 0, closed=0.4)
    monkeypatch.setitem(risk.CORRECTION_GAIN, "pipemare-lr/adamw", 0.5)
    assert risk.uncorrected_distance(
        "pipeoptim+pipemare", "adamw", 7, 0, closed=0.4
    ) == pytest.approx(0.5 * predicted)


def test_gain_table_averages_the_depths() -> None:
    rows = [
        {"correction": "pipemare-lr", "optimizer": "adamw", "stages": 8, "gain": 0.2},
        {"correction": "pipemare-lr", "optimizer": "adamw", "stages": 16, "gain": 0.4},
        {"correction": "delay-momentum", "optimizer": "nadam", "stages": 8, "gain": -0.1},
    ]
    assert risk.gain_table(rows) == {"delay-momentum/nadam": -0.1, "pipemare-lr/adamw": 0.3}


def test_depth_advice_names_what_converged_with_few_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the time tables (an older study's file): every figure is against gpipe under
    the user's own optimizer, and the advice is the best configuration for that optimizer:
    a never-micro-batched asynchronous row first, then a micro-batched one, else a
    synchronous method, each said plainly."""
    monkeypatch.setattr(risk, "DEPTH_SPEED", {})
    monkeypatch.setattr(risk, "DEPTH_EQUAL_TIME", {})
    excess = {"pipeoptim": 0.4, "xpipe": 0.02, "gpipe": 0.0, "pipedream+pipemare": 0.01}
    monkeypatch.setattr(risk, "DEPTH_EXCESS", {8: excess})
    copies = {"pipeoptim": 2, "xpipe": 2, "gpipe": 1, "pipedream+pipemare": 8}
    monkeypatch.setattr(risk, "DEPTH_COPIES", {8: copies})
    monkeypatch.setattr(risk, "DEPTH_EXCESS_FIRST", {})  # no row across optimizers here
    text = risk.depth_advice("pipeoptim", 12, "adamw")
    assert text is not None
    assert "pipeoptim at 12 stages" in text and "at 8 stages" in text and "+40.0 %" in text
    assert "over gpipe's final test loss under adamw" in text
    # the asynchronous row that converged with at most 2 copies, not gpipe nor the stash;
    # micro-batched, and said so
    assert (
        "the best at this depth is micro-batched: xpipe came within 2.0 % with 2 weight "
        "copies per stage (--method xpipe)"
    ) in text
    assert risk.depth_advice("pipeoptim", 12, "adam") == text  # Adam reads AdamW's rows
    assert risk.depth_advice("pipeoptim", 8, "muon") is None  # no "pipeoptim (muon)" row
    assert risk.depth_advice("xpipe", 8, "adamw") is None  # it converged
    assert risk.depth_advice("pipeoptim", 4, "adamw") is None  # nothing measured that shallow
    assert risk.depth_advice("pipeoptim", 8, "sgd") is None  # not measured under SGD
    # a never-micro-batched row that converged comes before xpipe
    excess["pipeoptim+shrink"], copies["pipeoptim+shrink"] = 0.025, 2
    assert "pipeoptim+shrink came within 2.5 % with 2 weight copies per stage" in str(
        risk.depth_advice("pipeoptim", 8, "adamw")
    )
    del excess["pipeoptim+shrink"]
    # a row trained at 8 stages only answers for deeper pipelines too, from its 8 stages
    excess["pipeoptim (nadam)"], copies["pipeoptim (nadam)"] = 0.5, 2
    monkeypatch.setitem(risk.DEPTH_EXCESS, 16, {"pipeoptim": 0.6, "xpipe": 0.01})
    deep = str(risk.depth_advice("pipeoptim", 16, "nadam"))
    assert "pipeoptim (nadam) at 16 stages" in deep and "at 8 stages" in deep and "+50.0 %" in deep
    assert "under nadam" in deep
    assert "at 16 stages" in str(risk.depth_advice("pipeoptim", 16, "adamw"))
    del excess["pipeoptim (nadam)"], risk.DEPTH_EXCESS[16]
    # a row of another optimizer that converged against its own gpipe is not AdamW's advice
    excess["pipeoptim+nesterov (muon)"] = 0.004
    copies["pipeoptim+nesterov (muon)"] = 2
    assert "muon" not in str(risk.depth_advice("pipeoptim", 8, "adamw"))
    # ...but it is Muon's, with both flags
    excess["pipeoptim (muon)"], copies["pipeoptim (muon)"] = 0.06, 2
    muon = str(risk.depth_advice("pipeoptim", 8, "muon"))
    assert "pipeoptim (muon) at 8 stages" in muon and "+6.0 % over gpipe's" in muon
    assert (
        "pipeoptim+nesterov (muon) came within 0.4 % with 2 weight copies per stage "
        "(--method pipeoptim+nesterov --optimizer muon)"
    ) in muon
    del excess["pipeoptim+nesterov (muon)"]
    excess["pipeoptim+Ŵbackward"], copies["pipeoptim+Ŵbackward"] = 0.001, 2  # a variant row
    assert "(--method pipeoptim, Pipeline(predicted_backward=True))" in str(
        risk.depth_advice("pipeoptim", 8, "adamw")
    )
    del excess["pipeoptim+Ŵbackward"]
    excess["xpipe"] = 0.2  # no asynchronous row converged: a synchronous method, said so
    sync = str(risk.depth_advice("pipeoptim", 8, "adamw"))
    assert (
        "nothing asynchronous under adamw with at most 2 weight copies per stage came within "
        "3 %: the best at this depth is a synchronous method (zb-h1 is gpipe's updates with "
        "the smallest bubble; --method zb-h1); the closest asynchronous was xpipe (+20.0 %, "
        "2 weight copies per stage; --method xpipe)"
    ) in sync
    excess["pipeoptim+nesterov (muon)"] = 0.059  # Muon's rows: none converged either
    copies["pipeoptim+nesterov (muon)"] = 2
    assert (
        "the best at this depth is a synchronous method (zb-h1 is gpipe's updates with the "
        "smallest bubble; --method zb-h1 --optimizer muon); the closest asynchronous was "
        "pipeoptim+nesterov (muon) (+5.9 %"
    ) in str(risk.depth_advice("pipeoptim", 8, "muon"))
    excess["pipeoptim+nesterov (muon)"] = -0.032  # an asynchronous row below its gpipe
    assert "pipeoptim+nesterov (muon) ended 3.2 % below gpipe's with 2 weight copies" in str(
        risk.depth_advice("pipeoptim", 8, "muon")
    )


def test_depth_advice_names_a_row_of_another_optimizer_below_the_users_gpipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where nothing of the user's optimizer converged, a never-micro-batched row of another
    optimizer that ends at or below gpipe under the user's optimizer is named with its
    flags; its excess is read against gpipe under AdamW for both and set one against the
    other (Muon's gpipe 10 % below AdamW's: a row 5 % below AdamW's is 5.6 % above it)."""
    monkeypatch.setattr(risk, "DEPTH_SPEED", {})
    monkeypatch.setattr(risk, "DEPTH_EQUAL_TIME", {})
    monkeypatch.setattr(
        risk, "DEPTH_EXCESS", {8: {"gpipe": 0.0, "pipeoptim": 0.5, "gpipe (muon)": 0.0}}
    )
    first = {
        "gpipe": 0.0,
        "pipeoptim": 0.5,
        "gpipe (muon)": -0.1,
        "pipeoptim (basis-rotation)": -0.08,
        "pipeoptim+nesterov (muon)": -0.05,
        "xpipe (muon)": -0.2,  # micro-batched: not this advice
        "pipedream (basis-rotation)": -0.3,  # 8 copies: not this advice
    }
    monkeypatch.setattr(risk, "DEPTH_EXCESS_FIRST", {8: first})
    copies = {row: 2 for row in first} | {"pipedream (basis-rotation)": 8, "gpipe": 1}
    monkeypatch.setattr(risk, "DEPTH_COPIES", {8: copies})
    text = str(risk.depth_advice("pipeoptim", 8, "adamw"))
    assert (
        "; under another optimizer, pipeoptim (basis-rotation) ended 8.0 % below gpipe's "
        "final loss under adamw (--method pipeoptim --optimizer basis-rotation)"
    ) in text
    assert risk._other_optimizer(8, "muon") == (
        "; under another optimizer, pipeoptim (basis-rotation) ended 2.2 % above gpipe's "
        "final loss under muon (--method pipeoptim --optimizer basis-rotation)"
    )
    first["pipeoptim (basis-rotation)"] = 0.0  # 11 % above Muon's gpipe: nothing to name
    assert risk._other_optimizer(8, "muon") == ""
    assert risk._other_optimizer(16, "adamw") == ""  # nothing measured at 16


def test_plan_recommends_a_correction_by_name_when_its_measured_gain_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The corrected methods share their base's simulated run (one simulation); with no
    measured gain the base ranks first, with a gain that closes the risk the correction is
    the recommendation, named."""
    methods = ["gpipe", "pipedream", "pipedream+pipemare"]
    monkeypatch.setitem(risk.CORRECTION_GAIN, "pipemare-lr/adamw", 0.0)
    plain = search(uniform_profile(), 8, methods=methods, optimizer="adamw")
    ranks = [c.method for c in plain]
    assert ranks.index("pipedream") < ranks.index("pipedream+pipemare")
    twin = {c.method: c for c in plain}
    assert twin["pipedream"].throughput == twin["pipedream+pipemare"].throughput
    monkeypatch.setitem(risk.CORRECTION_GAIN, "pipemare-lr/adamw", 1.0)
    ranked = search(uniform_profile(), 8, methods=methods, optimizer="adamw")
    assert ranked[0].method == "pipedream+pipemare"
    assert ranked[0].risk is not None and ranked[0].risk.risk == 0.0
    assert explain(ranked).startswith("Run pipedream+pipemare with 1 micro-batch")


def test_plan_names_the_best_configuration_for_the_users_optimizer_and_depth(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``pipeoptim plan`` gives the study's advice for the chosen method at the M it chose
    under the user's optimizer at that depth, against zb-h1 and gpipe under that optimizer,
    and what to run instead: here, plainly, that the best under Muon at 8 stages is the
    synchronous zb-h1, and under AdamW xpipe, simulated faster than zb-h1 and within 1 % of
    gpipe."""
    from pipeoptim.cli import main

    profile = str(STUDY / "gpt-deep" / "profile.json")
    argv = ["plan", "--profile", profile, "--stages", "8", "--method", "pipeoptim"]
    assert main([*argv, "--optimizer", "muon", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    advice, m = data["study_advice"], data["plan"]["micro_batches"]
    assert advice == risk.depth_advice("pipeoptim", 8, "muon", m)
    assert "at 8 stages" in advice and "under muon" in advice
    for optimizer in ("muon", "adamw"):
        assert main([*argv, "--optimizer", optimizer, "--json"]) == 0
        advice = json.loads(capsys.readouterr().out)["study_advice"]
        ranked = risk.faster_to_target(8, optimizer)
        if ranked:  # the committed study's first choice, with the flags to type
            assert f": {ranked[0]} (" in advice and risk._flags(ranked[0]) in advice
        else:
            assert "the best at this depth is the synchronous zb-h1" in advice
    assert main([*argv, "--optimizer", "sgd", "--json"]) == 0  # the study has no SGD rows
    assert json.loads(capsys.readouterr().out)["study_advice"] is None


def test_an_unmeasured_optimizer_takes_the_largest_kappa_measured_on_every_model() -> None:
    """RMSprop's risk uses the largest κ of the optimizers the study measured on every
    model, not one fitted to a few language-model rows (NAdam's, Muon's)."""
    default, kappa = risk.DEFAULT_KAPPA, risk.KAPPA
    assert default == max(kappa["sgd"], kappa["adam"], kappa["adamw"]) == kappa["adamw"]
    assert kappa["nadam"] > default  # fitted, used for NAdam itself, not as the default
