"""A profile is taken under a rank's conditions and says so; plan and simulate warn when a
CPU profile's thread count is not what each rank of the run gets on this machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.profile import Profile, conditions_warning, threads_per_rank


def test_profile_records_the_threads_and_neighbours_it_ran_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "--model", "mlp", "--batch-size", "16", "--repeats", "1"]
    assert main([*argv, "--threads", "1", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    profile = Profile.load(out)
    assert profile.meta["threads"] == 1 and profile.meta["neighbours"] == 0
    assert profile.meta["batch_sizes"] == [16, 8, 4, 2]
    assert all(layer.update_s > 0 for layer in profile.layers if layer.param_bytes)
    assert main([*argv, "--ranks", "2", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    profile = Profile.load(out)
    assert profile.meta["threads"] == threads_per_rank(2)
    assert profile.meta["neighbours"] == 1  # one busy process stood in for the other rank
    # what the runtime costs here beyond the layers: a message over gloo, every policy's
    # fixed work per action, the slowdown of work between waits (issue 34)
    runtime = profile.runtime_costs
    assert runtime is not None and "runtime_costs_failed" not in profile.meta
    assert "messages_failed" not in profile.meta
    assert runtime.message_send_s > 0 and runtime.message_receive_s > 0
    # the messages' work is the runtime's own, fitted from the model run on 2 processes
    probe = profile.meta["message_probe"]
    assert "message_probe_failed" not in profile.meta
    assert probe["method"] == "1f1b" and probe["stages"] == 2 and probe["mini_batches"] >= 24
    assert (runtime.message_send_s, runtime.message_receive_s) == (
        probe["send_s"],
        probe["receive_s"],
    )
    assert runtime.burst_slowdown >= 1.0 and runtime.shared_burst_slowdown >= 1.0
    assert runtime.burst_s >= 0.0 and runtime.shared_burst_s >= 0.0  # a wait's, in seconds
    assert set(runtime.action_s) == {"flush", "stash", "double-buffer", "predict"}
    assert set(runtime.action_s["flush"]) == {"F", "B", "U", "I", "W"}
    assert profile.machine is not None and profile.machine.ranks_per_host == 2
    assert main([*argv, "--ranks", "0", "--out", str(out)]) == 2
    assert "--ranks must be between 1" in capsys.readouterr().err


def test_plan_and_simulate_warn_about_other_threads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    many = (os.cpu_count() or 1) + 5  # no rank on this machine gets that many
    profile = Profile.from_costs(
        [1e-3] * 4, [2e-3] * 4, [64] * 4, [256] * 4, device="cpu", batch_size=8
    )
    profile = Profile(**{**profile.__dict__, "meta": {"threads": many}})
    path, plan = tmp_path / "p.json", tmp_path / "plan.json"
    profile.save(path)
    argv = ["plan", "--profile", str(path), "--stages", "2", "--method", "1f1b"]
    assert main([*argv, "--out", str(plan), "--json"]) == 0
    err = capsys.readouterr().err
    expected = threads_per_rank(2)
    assert f"taken with {many} CPU thread(s), but 2 rank(s) on this machine get {expected}" in err
    assert "pipeoptim profile --ranks 2" in err
    assert main(["simulate", "--profile", str(path), "--stages", "2", "--json"]) == 0
    assert "--ranks 2" in capsys.readouterr().err
    assert main(["simulate", "--plan", str(plan), "--json"]) == 0  # the plan keeps the count
    captured = capsys.readouterr()
    assert json.loads(captured.out)["runs"] and f"taken with {many} CPU thread(s)" in captured.err
    # a profile with the right count, or from a device other than the CPU, is not judged
    assert conditions_warning("cpu", expected, 2) is None
    assert conditions_warning("cuda:0", many, 2) is None
    assert conditions_warning("cpu", None, 2) is None
    # a batch too small to split into one micro-batch per stage is refused with the fix
    Profile(**{**profile.__dict__, "batch_size": 1}).save(path)
    assert main(["plan", "--profile", str(path), "--stages", "2", "--method", "1f1b"]) == 2
    assert "profile with --batch-size 2 or more" in capsys.readouterr().err
