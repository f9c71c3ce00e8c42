"""benchmarks/bench_fidelity_set.py's offline columns on a profile of fixed numbers: the
prediction now is what the measured components add up to, and its "before" column is the
model before the burst fix (every action's work times the ping-pong's ratio, no wait
cost). Its real runs (profile, train) are the script's own, too slow for a test."""

from __future__ import annotations

import sys

import pytest
from support import benchmark_scripts

from pipeoptim.plan.machine import Machine
from pipeoptim.plan.profile import LayerProfile, Profile
from pipeoptim.plan.runtime_costs import RuntimeCosts

RUNTIME = RuntimeCosts(
    message_send_s=0.05,
    message_receive_s=0.07,
    burst_slowdown=2.0,
    shared_burst_slowdown=2.0,
    action_s={"predict": {"F": 0.1, "B": 0.2, "U": 0.3}},
    burst_s=0.04,
)


def test_the_offline_columns_are_the_components_now_and_the_old_ratio_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(benchmark_scripts.FOLDER))  # it imports bench_fidelity
    bench = benchmark_scripts.load("bench_fidelity_set")
    layers = tuple(LayerProfile(f"{i}:x", 1.0, 2.0, 0, 4, 4, 1, update_s=1.0) for i in range(2))
    meta = {"ranks": 2, "machine": Machine(2, 2, 1).to_dict()}
    profile = Profile(layers, 1, "sgd", "cpu", meta=meta, runtime_costs=RUNTIME)
    bounds = [(0, 1), (1, 2)]
    # one rank's mini-batch: layers, the policy's fixed work, a message each way, one wait
    now = bench.offline(profile, "pipeoptim", bounds, 1, 1)
    assert now == pytest.approx(4.0 + 0.6 + 0.05 + 0.07 + 0.04)
    before = bench.offline(profile, "pipeoptim", bounds, 1, 1, before=True)
    assert before == pytest.approx(2.0 * (4.0 + 0.6) + 0.05 + 0.07)
    sys.modules.pop("bench_fidelity", None)
