"""``pipeoptim simulate`` end to end."""

from __future__ import annotations

import json

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.graph import stage_graph, stage_graph_to_dict
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.trace import Trace


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_all_methods_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--stages", "4"]) == 0
    out = capsys.readouterr().out
    for name in (
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "pipedream",
        "2bw",
        "spectrain",
        "xpipe",
        "pipeoptim",
    ):
        assert f"\n{name} " in out
    assert "bubble" in out and "copies" in out


def test_all_skips_methods_whose_rules_reject_the_sizes(capsys) -> None:
    data = _json(capsys, "--stages", "4", "--micro-batches", "2")
    skipped = {s["method"]: s["reason"] for s in data["skipped"]}
    assert set(skipped) == {
        "1f1b",
        "interleaved-1f1b",
        "2bw",
        "2bw+extrapolate",
        "zb-h1",
        "interleaved-zb",
    }
    assert data["runs"]["dualpipev"]["shape"]["micro_batches"] == 2  # a V takes any M too
    assert "raise --micro-batches to 4" in skipped["1f1b"]
    runs = data["runs"]
    assert runs["zb-v"]["shape"]["micro_batches"] == 2  # the V takes any M
    assert runs["pipedream"]["shape"]["micro_batches"] == 1  # does not micro-batch
    assert runs["pipeoptim"]["shape"]["micro_batches"] == 2  # the dial takes the given M
    assert runs["gpipe"]["shape"]["micro_batches"] == 2
    assert runs["gpipe"]["bubble_ratio"] == pytest.approx(3 / 5)
    assert main(["simulate", "--stages", "4", "--micro-batches", "2"]) == 0
    assert "note: skipped 1f1b" in capsys.readouterr().out


def test_single_method_errors_exit_2(capsys) -> None:
    assert main(["simulate", "--method", "1f1b", "--stages", "4", "--micro-batches", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs at least as many micro-batches as stages" in err
    assert "Traceback" not in err
    assert main(["simulate", "--method", "nope", "--stages", "2"]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(["simulate", "--method", "gpipe"]) == 2
    assert "--stages" in capsys.readouterr().err
    assert main(["simulate", "--stages", "2", "--uniform", "1"]) == 2
    assert "--uniform" in capsys.readouterr().err


def test_uniform_update_links_and_interleaved(capsys) -> None:
    data = _json(
        capsys,
        "--method",
        "gpipe,interleaved-1f1b",
        "--stages",
        "2",
        "--micro-batches",
        "2",
        "--mini-batches",
        "1",
        "--uniform",
        "1,2,0.5",
    )
    gpipe = data["runs"]["gpipe"]
    assert gpipe["span_s"] == (2 + 2 - 1) * 3 + 0.5
    inter = data["runs"]["interleaved-1f1b"]
    assert inter["shape"]["virtual_stages"] == 2 and inter["shape"]["num_stages"] == 4
    link = [
        "--method",
        "gpipe",
        "--stages",
        "2",
        "--micro-batches",
        "2",
        "--mini-batches",
        "1",
        "--uniform",
        "1,2,0.5",
        "--activation-bytes",
        "1KB",
        "--bandwidth",
        "1KB/s",
        "--latency",
        "0.5",
    ]
    # every crossing takes 0.5 + 1 s; as pure delays only the first F and last B add up
    free = _json(capsys, *link, "--no-contention")
    assert free["runs"]["gpipe"]["span_s"] == gpipe["span_s"] + 2 * 1.5
    # on a queued link 0F1's activation waits 0.5 s for 0F0's: the whole run shifts by it
    queued = _json(capsys, *link)
    assert queued["runs"]["gpipe"]["span_s"] == gpipe["span_s"] + 2 * 1.5 + 0.5


def test_files_are_written(tmp_path, capsys) -> None:
    html, trace, chrome = tmp_path / "r.html", tmp_path / "t.json", tmp_path / "c.json"
    argv = [
        "simulate",
        "--method",
        "pipeoptim,1f1b",
        "--stages",
        "2",
        "--html",
        str(html),
        "--trace",
        str(trace),
        "--chrome-trace",
        str(chrome),
        "--param-bytes",
        "1MiB",
        "--optimizer",
        "adam",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "MiB" in out
    assert html.read_text().startswith("<!DOCTYPE html>")
    loaded = Trace.load(tmp_path / "t-pipeoptim.json")
    assert loaded.meta["method"] == "pipeoptim" and loaded.meta["optimizer"] == "adam"
    chrome_data = json.loads((tmp_path / "c-1f1b.json").read_text())
    assert any(e.get("ph") == "X" for e in chrome_data["traceEvents"])
    single = tmp_path / "one.json"
    assert main(["simulate", "--method", "gpipe", "--stages", "2", "--trace", str(single)]) == 0
    assert Trace.load(single).meta["method"] == "gpipe"


def test_fast_engine_and_jitter(capsys) -> None:
    a = _json(capsys, "--method", "1f1b", "--stages", "3", "--engine", "fast")
    b = _json(capsys, "--method", "1f1b", "--stages", "3")
    assert a["runs"]["1f1b"]["span_s"] == b["runs"]["1f1b"]["span_s"]
    j1 = _json(capsys, "--method", "1f1b", "--stages", "3", "--jitter", "0.3", "--seed", "5")
    j2 = _json(capsys, "--method", "1f1b", "--stages", "3", "--jitter", "0.3", "--seed", "5")
    assert j1["runs"] == j2["runs"]
    assert j1["runs"]["1f1b"]["span_s"] != b["runs"]["1f1b"]["span_s"]


def _profile(tmp_path) -> tuple[Profile, str]:
    profile = Profile.uniform(8, 0.5, 1.0, activation_bytes=1000, param_bytes=4000, batch_size=4)
    path = tmp_path / "profile.json"
    profile.save(path)
    return profile, str(path)


def test_profile_and_plan(tmp_path, capsys) -> None:
    profile, path = _profile(tmp_path)
    data = _json(
        capsys,
        "--method",
        "gpipe",
        "--stages",
        "4",
        "--micro-batches",
        "4",
        "--mini-batches",
        "1",
        "--profile",
        path,
    )
    # 2 layers per stage, costs of a 4-sample mini-batch split into 4 micro-batches
    assert data["runs"]["gpipe"]["span_s"] == pytest.approx((4 + 4 - 1) * 3.0 / 4)
    assert data["runs"]["gpipe"]["peak_memory_bytes"] > 0

    graph = stage_graph(profile, [(0, 2), (2, 8)])
    plan = Plan(
        "1f1b",
        2,
        micro_batches=2,
        mini_batches=1,
        boundaries=[(0, 2), (2, 8)],
        stage_graph=stage_graph_to_dict(graph),
    )
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    data = _json(capsys, "--plan", str(plan_path))
    assert list(data["runs"]) == ["1f1b"]
    run = data["runs"]["1f1b"]
    assert run["shape"]["micro_batches"] == 2
    # the slow stage (6 layers: F=1.5, B=3 per micro-batch of 2 samples) dominates
    assert run["stages"]["1"]["busy_s"] == pytest.approx(2 * (1.5 + 3.0))
    bare = Plan("1f1b", 2, micro_batches=2, mini_batches=1)
    bare.save(plan_path)
    assert main(["simulate", "--plan", str(plan_path)]) == 2
    assert "--profile" in capsys.readouterr().err
    data = _json(capsys, "--plan", str(plan_path), "--profile", path)
    # the bare plan splits the 8 profiled layers evenly: 4 and 4, F=1 and B=2 per
    # micro-batch of 2 samples on each stage
    run = data["runs"]["1f1b"]
    assert run["stages"]["0"]["busy_s"] == pytest.approx(run["stages"]["1"]["busy_s"])
    assert run["stages"]["1"]["busy_s"] == pytest.approx(2 * (1.0 + 2.0))
