"""Plan search for a method that places several stages on every rank (dualpipev,
interleaved-zb, zb-v, interleaved-1f1b): the P x v stages partitioned, each rank's memory
(its stages together) held to the cap, the device search's refusal with its fix, and a plan
of dualpipev for the built-in MLP that trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.errors import PlanError
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.planning import PlanLimits, plan_for


def _profile() -> Profile:
    return Profile.uniform(8, 0.01, 0.02, activation_bytes=1000, param_bytes=4000, batch_size=64)


@pytest.mark.parametrize("method", ["dualpipev", "interleaved-zb"])
def test_the_cap_holds_each_rank_to_its_stages_together(method: str) -> None:
    profile = _profile()
    free = plan_for(profile, stages=2, method=method)
    best = free.best
    assert best.partition is not None and best.virtual_stages == 2
    # placed as the method places them: a V for dualpipev, looped for interleaved-zb
    assert best.stage_ranks == ((0, 1, 1, 0) if method == "dualpipev" else (0, 1, 0, 1))
    rank_peak = best.peak_memory_bytes
    # a rank's two stages together hold more than its fullest stage alone
    assert rank_peak > max(best.partition.stage_memory)
    fits = plan_for(profile, stages=2, method=method, limits=PlanLimits(memory_cap_bytes=rank_peak))
    assert fits.plan.boundaries == free.plan.boundaries
    with pytest.raises(PlanError, match="holds 2 stages that together peak at") as err:
        plan_for(
            profile, stages=2, method=method, limits=PlanLimits(memory_cap_bytes=rank_peak - 1)
        )
    assert "raise --memory-cap to at least" in str(err.value)


def test_more_stages_than_units_is_refused_with_the_fix() -> None:
    with pytest.raises(PlanError, match="use at most 4 --stages"):
        plan_for(_profile(), stages=5, method="zb-v")


def test_device_search_refuses_them_with_the_way_out() -> None:
    with pytest.raises(PlanError, match="plan it with --stages P"):
        plan_for(_profile(), devices=4, method="dualpipev")


def test_auto_still_ranks_one_stage_per_rank() -> None:
    ranked = plan_for(_profile(), stages=2).ranked
    assert all(c.virtual_stages == 1 for c in ranked)
    assert "dualpipev" not in {c.method for c in ranked}


def test_a_dualpipev_plan_of_the_builtin_mlp_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    argv = ["profile", "--model", "mlp", "--repeats", "1", "--batch-size", "16"]
    assert main([*argv, "--out", str(profile)]) == 0
    argv = ["plan", "--profile", str(profile), "--stages", "2", "--method", "dualpipev"]
    assert main([*argv, "--out", str(plan)]) == 0
    chosen = Plan.load(plan)
    assert (chosen.method, chosen.num_stages, chosen.virtual_stages) == ("dualpipev", 2, 2)
    capsys.readouterr()
    assert main(["train", "--plan", str(plan), "--max-steps", "2", "--transport", "local"]) == 0
    assert "dualpipev, 4 stages on 2 ranks" in capsys.readouterr().out
