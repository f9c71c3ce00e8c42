"""The message probe (``workloads/message_probe.py``) and how a profile uses it: the
runtime's own work per message where the probe ran, gloo's alone (and why not) where it
could not. The real probe runs in ``tests/cli/test_profile_conditions.py``; here its
result is stood in for, so each case costs one profile of a small model."""

from __future__ import annotations

from typing import Any

import pytest

from pipeoptim.runtime.profiling.messages import MessageTiming, wait_for_result
from pipeoptim.workloads import profiling
from pipeoptim.workloads.message_probe import RuntimeMessages, probe_messages

GLOO = MessageTiming(
    send_s=4e-5,
    receive_s=5e-5,
    latency_s=1e-6,
    burst_slowdown=1.25,
    shared_burst_slowdown=2.5,
    rounds=10,
    burst_s=3e-5,
    shared_burst_s=9e-5,
)


def _profile(monkeypatch: pytest.MonkeyPatch, probe: Any) -> Any:
    monkeypatch.setattr(profiling, "time_messages", lambda: GLOO)
    monkeypatch.setattr(profiling, "probe_messages", probe)
    return profiling.profile_builtin("mlp", batch_size=16, repeats=1, ranks=2)


def test_a_profile_charges_the_runtimes_own_message_work_where_the_probe_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: dict[str, Any] = {}

    def probe(model: str, **options: Any) -> RuntimeMessages:
        asked.update(options, model=model)
        return RuntimeMessages(1.5e-4, 2.5e-4, options["steps"])

    profile = _profile(monkeypatch, probe)
    runtime = profile.runtime_costs
    assert (runtime.message_send_s, runtime.message_receive_s) == (1.5e-4, 2.5e-4)
    # gloo's ping-pong still gives the latency and the slowdowns
    assert runtime.message_latency_s == GLOO.latency_s
    assert (runtime.burst_slowdown, runtime.shared_burst_slowdown) == (1.25, 2.5)
    assert (runtime.burst_s, runtime.shared_burst_s) == (3e-5, 9e-5)  # a wait's cost
    low, high = profiling.PROBE_STEPS
    assert asked["model"] == "mlp" and asked["batch_size"] == 16
    assert low <= asked["steps"] <= high
    assert profile.meta["message_probe"] == {
        "method": "1f1b",
        "stages": 2,
        "mini_batches": asked["steps"],
        "send_s": 1.5e-4,
        "receive_s": 2.5e-4,
    }


def test_a_failed_probe_leaves_glooes_message_cost_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def probe(model: str, **options: Any) -> RuntimeMessages:
        raise RuntimeError("the message probe's processes stopped without a result")

    profile = _profile(monkeypatch, probe)
    runtime = profile.runtime_costs
    assert (runtime.message_send_s, runtime.message_receive_s) == (GLOO.send_s, GLOO.receive_s)
    assert "message_probe" not in profile.meta
    assert profile.meta["message_probe_failed"] == (
        "RuntimeError: the message probe's processes stopped without a result"
    )


def test_the_probe_needs_a_few_mini_batches_for_a_steady_state() -> None:
    with pytest.raises(ValueError, match=r"4 mini-batches or more .* \(got 3\)"):
        probe_messages("mlp", batch_size=16, steps=3)


class _Proc:
    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None


class _Results:
    def __init__(self, *items: Any) -> None:
        self.items = list(items)

    def empty(self) -> bool:
        return not self.items

    def get(self) -> Any:
        return self.items.pop(0)


def test_waiting_for_a_result_names_the_process_that_stopped_without_one() -> None:
    names = ["rank 0", "rank 1"]
    assert wait_for_result(_Results((1.0, 2.0)), [_Proc(0), _Proc(0)], 1.0, names) == (1.0, 2.0)
    with pytest.raises(RuntimeError, match="rank 0 exited with code 0"):
        wait_for_result(_Results(), [_Proc(0), _Proc(None)], 1.0, names)
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        wait_for_result(_Results(), [_Proc(None), _Proc(3)], 1.0, names)
    # another process done cleanly is no failure: the wait goes on until the deadline
    with pytest.raises(RuntimeError, match=r"rank 0 sent no result in 0 s"):
        wait_for_result(_Results(), [_Proc(None), _Proc(0)], 0.05, names)
