"""Planning for a stated maximum sequence length (``plan/sequence_length.py``): a profile's
activation bytes and per-sample times scale linearly in tokens, so the memory model, the
simulator and the planner all see the longest batch; a profile that does not say its length
is refused with the fix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.errors import PlanError
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.sequence_length import at_length, measured_length
from pipeoptim.planning import PlanLimits, plan_for


def lm_profile(length: int = 32) -> Profile:
    fwd = [0.01 * (1 + (i % 3)) for i in range(8)]
    profile = Profile.from_costs(
        fwd, [2 * f for f in fwd], [2_000_000] * 8, [1_000_000] * 8, batch_size=16
    )
    return replace(profile, meta={"input_shape": [16, length], "input_dtype": "torch.int64"})


def test_the_measured_length_is_stated_or_read_from_token_ids() -> None:
    assert measured_length(lm_profile(32)) == 32
    stated = replace(lm_profile(), meta={"sequence_length": 48})
    assert measured_length(stated) == 48
    floats = replace(lm_profile(), meta={"input_shape": [16, 32], "input_dtype": "torch.float32"})
    assert measured_length(floats) is None


def test_activation_bytes_and_times_scale_with_the_tokens() -> None:
    profile = lm_profile(32)
    longer = at_length(profile, 64)
    for a, b in zip(profile.layers, longer.layers, strict=True):
        assert b.activation_bytes == 2 * a.activation_bytes
        assert b.forward_s == pytest.approx(2 * a.forward_s)
        assert b.backward_s == pytest.approx(2 * a.backward_s)
        assert b.param_bytes == a.param_bytes and b.optimizer_state_bytes == a.optimizer_state_bytes
    assert measured_length(longer) == 64 and longer.meta["measured_length"] == 32
    assert at_length(profile, 32) is profile


def test_a_fixed_part_of_a_time_does_not_scale() -> None:
    profile = lm_profile(32)
    fixed = replace(
        profile, layers=tuple(replace(x, forward_fixed_s=0.005) for x in profile.layers)
    )
    layer, base = at_length(fixed, 64).layers[0], fixed.layers[0]
    assert layer.forward_s == pytest.approx(0.005 + 2 * (base.forward_s - 0.005))


def test_the_planner_plans_for_the_stated_maximum() -> None:
    profile = lm_profile(32)
    short = plan_for(profile, stages=2, method="1f1b").best
    long = plan_for(at_length(profile, 128), stages=2, method="1f1b").best
    assert long.partition is not None and short.partition is not None
    assert long.partition.peak_memory_bytes > short.partition.peak_memory_bytes
    assert long.throughput < short.throughput
    # a cap the measured length fits as it is, the maximum length only by recomputing
    cap = (short.partition.peak_memory_bytes + long.partition.peak_memory_bytes) // 2
    limits = PlanLimits(memory_cap_bytes=cap)
    fits = plan_for(profile, stages=2, method="1f1b", limits=limits).best
    assert fits.partition is not None and not any(fits.recompute)
    recomputed = plan_for(at_length(profile, 128), stages=2, method="1f1b", limits=limits).best
    assert any(recomputed.recompute) and recomputed.peak_memory_bytes <= cap


def test_the_commands_take_a_maximum_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "profile.json"
    lm_profile(32).save(source)
    out = tmp_path / "plan.json"
    args = ["plan", "--profile", str(source), "--stages", "2", "--method", "1f1b"]
    assert main([*args, "--max-length", "64", "--out", str(out)]) == 0
    assert out.exists()
    sim = ["simulate", "--profile", str(source), "--stages", "2", "--method", "1f1b"]
    assert main([*sim, "--max-length", "64"]) == 0
    capsys.readouterr()
    assert main(["simulate", "--stages", "2", "--method", "1f1b", "--max-length", "64"]) == 2
    assert "give --profile FILE" in capsys.readouterr().err


def test_a_profile_without_its_length_is_refused_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(PlanError, match=r"add \"sequence_length\""):
        at_length(replace(lm_profile(), meta={}), 64)
    with pytest.raises(PlanError, match="whole number >= 1"):
        at_length(lm_profile(), 0)
    source = tmp_path / "profile.json"
    replace(lm_profile(), meta={}).save(source)
    code = main(["plan", "--profile", str(source), "--stages", "2", "--max-length", "64"])
    assert code == 2
    assert "sequence_length" in capsys.readouterr().err
