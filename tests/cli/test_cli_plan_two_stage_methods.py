"""dualpipev, interleaved-zb, zb-v and interleaved-1f1b in the planner and the simulator's
command: `pipeoptim plan --method NAME --stages P` partitions the units into the method's
P x v stages and writes a plan that `pipeoptim simulate --plan` runs; --method auto still
ranks only the methods it ranks by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.methods import RANKED_BY_DEFAULT
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile


@pytest.mark.parametrize(
    ("method", "extra", "per_rank"),
    [
        ("dualpipev", [], 2),
        ("zb-v", [], 2),
        ("interleaved-zb", ["--virtual-stages", "2"], 2),
        ("interleaved-1f1b", ["--virtual-stages", "3"], 3),
    ],
)
def test_plan_partitions_their_stages_and_simulate_runs_the_plan(
    method: str,
    extra: list[str],
    per_rank: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert method not in RANKED_BY_DEFAULT
    path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile = Profile.uniform(12, 0.01, 0.02, activation_bytes=100, param_bytes=1000, batch_size=64)
    profile.save(path)
    argv = ["plan", "--profile", str(path), "--stages", "2", "--method", method]
    assert main([*argv, *extra, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{per_rank} stages on each of 2 ranks" in text
    assert "peak rank memory (its stages together)" in text
    assert text.splitlines()[0].split()[:3] == ["stage", "rank", "layers"]
    plan = Plan.load(out)
    assert (plan.method, plan.num_stages, plan.virtual_stages) == (method, 2, per_rank)
    assert plan.boundaries is not None and len(plan.boundaries) == 2 * per_rank
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][method]
    assert run["shape"]["virtual_stages"] == per_rank and 0 < run["bubble_ratio"] < 1


def test_virtual_stages_needs_a_method_that_takes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "profile.json"
    Profile.uniform(8, 0.01, 0.02, batch_size=64).save(path)
    argv = ["plan", "--profile", str(path), "--stages", "2", "--virtual-stages", "2"]
    assert main([*argv, "--method", "gpipe"]) == 2
    err = capsys.readouterr().err
    assert "--virtual-stages 2" in err and "but --method is gpipe" in err
    assert main([*argv, "--method", "dualpipev", "--virtual-stages", "3"]) == 2
    assert "exactly 2 stages on every rank" in capsys.readouterr().err
