"""The memory model agrees with the version analysis and adds up."""

from __future__ import annotations

import pytest

from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.sim import CostModel, compile_method, list_schedule, memory_report, simulate


@pytest.mark.parametrize("name", list(METHODS))
def test_peaks_match_version_report(name: str) -> None:
    method = get_method(name)
    shape = method.shape(4, None, 6)
    costs = CostModel.uniform(
        shape.num_stages, 1.0, 2.0, 0.3, param_bytes=1000, activation_bytes=10, optimizer="adam"
    )
    program = compile_method(method, shape)
    timing = list_schedule(program, program.durations(costs), program.transfer_times(costs))
    report = memory_report(program, timing, costs)
    versions = program.versions()
    for k, peak in report.peaks.items():
        assert peak.weight_copies == versions.weight_copies[k]
        assert peak.activations == versions.max_in_flight[k]
        assert peak.bytes <= (peak.weight_copies + 3) * 1000 + 10 * peak.activations
        assert peak.bytes >= 4000  # weights, gradients and two Adam moments at least
    assert report.peak_bytes() == max(p.bytes for p in report.peaks.values())


def test_samples_are_ordered_and_add_up() -> None:
    method = get_method("interleaved-1f1b")
    shape = method.shape(2, 4, 2)
    trace = simulate(method, shape, CostModel.uniform(4, param_bytes=100, activation_bytes=7))
    for rank in (0, 1):
        samples = [s for s in trace.memory if s.rank == rank]
        times = [s.time for s in samples]
        assert times == sorted(times) and len(set(times)) == len(times)
        for s in samples:
            per_stage = {k: v for k, v in s.detail.items() if k.startswith("stage:")}
            assert sorted(per_stage) == [f"stage:{rank}", f"stage:{rank + 2}"]
            assert sum(per_stage.values()) == s.bytes
            categories = ("weights", "stash", "gradients", "optimizer", "activations")
            assert sum(s.detail[c] for c in categories) == s.bytes
    peaks = trace.meta["peak_memory"]
    assert set(peaks) == {"0", "1", "2", "3"}


def test_no_samples_when_disabled() -> None:
    method = get_method("gpipe")
    trace = simulate(method, method.shape(2, 2, 1), CostModel.uniform(2), memory=False)
    assert trace.memory == []
    assert trace.meta["peak_memory"] == {"0": 0, "1": 0}
