"""The layout probe (``workloads/layout_probe.py``): where the ranks take turns on the
cores, a profile's layer times and message costs are what calibration fits from a short
run in the planned layout. Here a one-process run's trace stands in for the probe's (its
calibration takes per-stage medians: the same adoption, no processes); the real probe runs
once at the end."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from pipeoptim.calibrate import calibrated_profile
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.profile import LayerProfile, Profile
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.profiling.messages import MessageTiming
from pipeoptim.sim.host import host_notes
from pipeoptim.trace import Trace
from pipeoptim.workloads import profiling
from pipeoptim.workloads.layout_probe import _excess_fixed, adopt_layout
from pipeoptim.workloads.loader import build_model, model_loss
from pipeoptim.workloads.message_probe import RuntimeMessages

GLOO = MessageTiming(4e-5, 5e-5, 1e-6, burst_slowdown=1.25, shared_burst_slowdown=2.5, rounds=10)
RANKS = 3


def _run_trace(batch_size: int = 16, steps: int = 6) -> Trace:
    """The probe's run (1F1B, a micro-batch per rank, the even split) in one process."""
    layers, data = build_model("mlp", 0)
    pipe = Pipeline(
        list(layers),
        "1f1b",
        stages=RANKS,
        micro_batches=RANKS if batch_size % RANKS == 0 else 1,
        optimizer=OptimizerSpec("sgd", 1e-4),
        loss_fn=model_loss("mlp"),
        log_every=steps + 1,
    )
    batches = [
        (data.train_x[i : i + batch_size], data.train_y[i : i + batch_size])
        for i in range(0, steps * batch_size, batch_size)
    ]
    return pipe.fit(batches, max_steps=steps).trace


def _profile(monkeypatch: pytest.MonkeyPatch, layout: Any, cores: int = 1) -> Profile:
    monkeypatch.setattr(profiling, "time_messages", lambda: GLOO)
    monkeypatch.setattr(profiling, "this_machine_cores", lambda: cores)
    monkeypatch.setattr(profiling, "probe_layout", layout)
    monkeypatch.setattr(
        profiling, "probe_messages", lambda model, **o: RuntimeMessages(1e-4, 2e-4, o["steps"])
    )
    return profiling.profile_builtin("mlp", batch_size=18, repeats=1, ranks=RANKS)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return _run_trace(batch_size=18)


def test_the_layers_take_the_calibrated_times_and_keep_the_rest(
    monkeypatch: pytest.MonkeyPatch, trace: Trace
) -> None:
    def layout(model: str, **options: Any) -> Trace:
        raise AssertionError("a core per rank: no layout probe")

    loop = _profile(monkeypatch, layout, cores=RANKS)  # the layers timed in a loop
    adopted = adopt_layout(loop, trace)
    fitted = calibrated_profile(trace, loop)
    slowdown = adopted.meta["layout_probe"]["slowdown"]
    work = math.fsum(x.forward_s + x.backward_s + x.update_s for x in fitted.layers)
    assert slowdown == pytest.approx(
        work / math.fsum(x.forward_s + x.backward_s + x.update_s for x in loop.layers)
    )
    probed = loop.batch_size / RANKS  # the probe's micro-batch
    for before, after, cal in zip(loop.layers, adopted.layers, fitted.layers, strict=True):
        # at the probe's micro-batch the calibrated times; per sample more, the loop's:
        # what the probe costs beyond the loop is fixed (an action after a wait)
        now = after.time_at(probed, loop.batch_size)
        sides = zip(
            before.time_at(probed, loop.batch_size),
            now,
            cal.time_at(probed, loop.batch_size),
            (before.forward_fixed_s, before.backward_fixed_s),
            (after.forward_fixed_s, after.backward_fixed_s),
            (
                before.forward_s - before.forward_fixed_s,
                before.backward_s - before.backward_fixed_s,
            ),
            (after.forward_s - after.forward_fixed_s, after.backward_s - after.backward_fixed_s),
            strict=True,
        )
        for loop_t, after_t, cal_t, loop_fixed, after_fixed, loop_per, after_per in sides:
            if loop_fixed + (cal_t - loop_t) >= 0.0:
                assert after_t == pytest.approx(cal_t, rel=1e-9, abs=1e-15)
                assert after_per == pytest.approx(loop_per, rel=1e-9, abs=1e-15)
            else:  # the run was faster than the loop's fixed part: no negative fixed part
                assert after_fixed == 0.0
                assert cal_t <= after_t * (1 + 1e-9) and after_t <= loop_t * (1 + 1e-9)
        assert after.update_s == cal.update_s
        # what the run does not measure stays the loop's: bytes, the split of a backward
        assert (after.name, after.param_bytes, after.activation_bytes) == (
            before.name, before.param_bytes, before.activation_bytes
        )  # fmt: skip
        assert after.weight_grad_fraction == before.weight_grad_fraction
        assert after.predict_s == pytest.approx(before.predict_s * slowdown)
    runtime, kept = adopted.runtime_costs, loop.runtime_costs
    assert runtime is not None and kept is not None
    # the slowdowns are in the layer times now; the latency is the ping-pong's
    assert (runtime.burst_slowdown, runtime.shared_burst_slowdown) == (1.0, 1.0)
    assert runtime.message_latency_s == kept.message_latency_s
    # each policy pays what it costs beyond the synchronous one the probe ran
    flush = kept.action_s["flush"]
    for policy, kinds in kept.action_s.items():
        for kind, value in kinds.items():
            if kind == "W":  # one more action than the probe ran: slowed as its actions
                assert runtime.action_s[policy][kind] == pytest.approx(value * slowdown)
                continue
            base = flush["B"] if kind == "I" else flush[kind]
            assert runtime.action_s[policy][kind] == pytest.approx(max(0.0, value - base))
    assert runtime.action_s["flush"]["F"] == 0.0
    record = adopted.meta["layout_probe"]
    assert record["method"] == "1f1b" and record["stages"] == RANKS
    assert record["micro_batches"] == RANKS and record["mini_batches"] == 6
    assert record["boundaries"] == trace.meta["boundaries"]


def test_a_profile_for_ranks_that_take_turns_runs_the_layout_probe(
    monkeypatch: pytest.MonkeyPatch, trace: Trace
) -> None:
    asked: dict[str, Any] = {}

    def layout(model: str, **options: Any) -> Trace:
        asked.update(options, model=model)
        return trace

    profile = _profile(monkeypatch, layout)
    assert asked["model"] == "mlp" and asked["stages"] == RANKS and asked["batch_size"] == 18
    low, high = profiling.LAYOUT_STEPS
    assert low <= asked["steps"] <= high
    assert profile.meta["layout_probe"]["stages"] == RANKS
    assert "message_probe" not in profile.meta  # the layout run measured the messages
    runtime = profile.runtime_costs
    assert runtime is not None and runtime.shared_burst_slowdown == 1.0
    assert (runtime.message_send_s, runtime.message_receive_s) == (
        profile.meta["layout_probe"]["send_s"],
        profile.meta["layout_probe"]["receive_s"],
    )
    # the report's notes say where the layer times came from, and no slowdown is charged
    notes = host_notes(profile, RANKS)
    slowdown = profile.meta["layout_probe"]["slowdown"]
    assert (
        f"layer times from the model run on {RANKS} rank processes of this host (1f1b, "
        f"{RANKS} micro-batches, 6 mini-batches): {slowdown:.2f}x their times in a loop "
        f"(measured)"
    ) in notes
    assert not any("work between waits" in n for n in notes)


def test_a_core_per_rank_keeps_the_message_probe(
    monkeypatch: pytest.MonkeyPatch, trace: Trace
) -> None:
    def layout(model: str, **options: Any) -> Trace:
        raise AssertionError("the layout probe runs only where the ranks take turns")

    profile = _profile(monkeypatch, layout, cores=RANKS)
    assert "layout_probe" not in profile.meta and "message_probe" in profile.meta
    runtime = profile.runtime_costs
    assert runtime is not None and runtime.shared_burst_slowdown == GLOO.shared_burst_slowdown


def test_a_failed_layout_probe_falls_back_to_the_message_probe_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def layout(model: str, **options: Any) -> Trace:
        raise RuntimeError("the probe's rank 2 exited with code 1")

    profile = _profile(monkeypatch, layout)
    assert profile.meta["layout_probe_failed"] == (
        "RuntimeError: the probe's rank 2 exited with code 1"
    )
    assert "layout_probe" not in profile.meta
    runtime = profile.runtime_costs
    assert runtime is not None
    assert (runtime.message_send_s, runtime.message_receive_s) == (1e-4, 2e-4)
    assert runtime.shared_burst_slowdown == GLOO.shared_burst_slowdown


@pytest.mark.slow
def test_the_real_probe_runs_the_ranks_as_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three processes over gloo, on however many cores this machine has (told it has
    one, the profile takes the ranks to take turns)."""
    monkeypatch.setattr(profiling, "this_machine_cores", lambda: 1)
    profile = profiling.profile_builtin("mlp", batch_size=18, repeats=1, ranks=RANKS)
    assert "layout_probe_failed" not in profile.meta, profile.meta.get("layout_probe_failed")
    record = profile.meta["layout_probe"]
    assert record["stages"] == RANKS and record["micro_batches"] == RANKS
    assert record["mini_batches"] >= profiling.LAYOUT_STEPS[0]
    assert record["slowdown"] > 0 and record["send_s"] > 0 and record["receive_s"] > 0
    assert all(x.forward_s > 0 and x.backward_s > 0 for x in profile.layers)


def test_a_run_faster_than_the_loops_fixed_part_leaves_no_negative_fixed_part() -> None:
    loop = LayerProfile("0:Linear", 4e-3, 8e-3, 0, 0, 0, 0, forward_fixed_s=1e-3)
    # at 4 of 16 samples the loop takes 1 + 3/4 = 1.75 ms forward, 2 ms backward
    slower = dataclasses.replace(loop, forward_s=6e-3, forward_fixed_s=3e-3, backward_s=12e-3)
    adopted = _excess_fixed(loop, slower, 4.0, 16)
    assert adopted.time_at(4.0, 16) == pytest.approx(slower.time_at(4.0, 16), rel=1e-12)
    assert adopted.forward_s - adopted.forward_fixed_s == pytest.approx(3e-3, rel=1e-12)
    # the run took 0.25 ms forward: 1.5 ms below the loop, more than its 1 ms fixed part
    faster = dataclasses.replace(loop, forward_s=1e-3, forward_fixed_s=0.0)
    clamped = _excess_fixed(loop, faster, 4.0, 16)
    assert clamped.forward_fixed_s == 0.0
    assert clamped.forward_s == pytest.approx(4e-3 - 1.5e-3, rel=1e-12)
    assert faster.time_at(4.0, 16)[0] <= clamped.time_at(4.0, 16)[0] <= loop.time_at(4.0, 16)[0]
