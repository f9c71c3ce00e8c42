"""dualpipev and interleaved-zb in the planner and the simulator's command, as zb-v: the plan
search (one stage per device) refuses them by name with the way out, and `pipeoptim
simulate` runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.methods import RANKED_BY_DEFAULT
from pipeoptim.plan.profile import Profile


@pytest.mark.parametrize("method", ["dualpipev", "interleaved-zb", "zb-v"])
def test_plan_search_refuses_them_as_zb_v_and_simulate_runs_them(
    method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert method not in RANKED_BY_DEFAULT
    path = tmp_path / "profile.json"
    profile = Profile.uniform(8, 0.01, 0.02, activation_bytes=100, param_bytes=1000, batch_size=64)
    profile.save(path)
    assert main(["plan", "--profile", str(path), "--stages", "2", "--method", method]) == 2
    err = capsys.readouterr().err
    assert f"{method} (several stages per device) is not searched" in err
    assert "pipeoptim simulate" in err
    argv = ["simulate", "--method", method, "--stages", "2", "--micro-batches", "4", "--json"]
    assert main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"][method]
    assert run["shape"]["micro_batches"] == 4 and 0 < run["bubble_ratio"] < 1
