"""Version analysis against the closed forms of docs/design.md, "Weight-version semantics"."""

from __future__ import annotations

import pytest

from pipeoptim.plan import analyze_versions, build_schedule, get_method
from pipeoptim.plan.versions import VersionReport, prediction_distance


def report(method: str, p: int, m: int | None, n: int) -> VersionReport:
    schedule, shape = build_schedule(method, p, m, n)
    return analyze_versions(schedule, get_method(method).weight_policy, shape.micro_batches)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_pipeoptim_distance_is_min_t_and_depth(p: int) -> None:
    n = 3 * p
    r = report("pipeoptim", p, None, n)
    for k in range(p):
        d = p - 1 - k
        for t in range(n):
            v = r.passes[(k, t)]
            assert r.distance(k, t) == min(t, d)
            assert v.forward_base == t - min(t, d)
            # the forward stands for the version its backward meets: no inconsistency
            assert v.forward_version == v.backward_version == t
            assert v.predicted == (min(t, d) > 0)
        assert r.max_staleness(k) == 0
        assert r.weight_copies[k] == (2 if d > 0 else 1)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_pipedream_stashes_p_minus_k_versions(p: int) -> None:
    n = 3 * p
    r = report("pipedream", p, None, n)
    for k in range(p):
        d = p - 1 - k
        assert r.weight_copies[k] == p - k
        assert r.max_in_flight[k] == p - k
        for t in range(n):
            v = r.passes[(k, t)]
            assert v.forward_version == v.backward_version == max(0, t - d)
            assert r.updates[(k, t)].staleness == min(t, d)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 6), (8, 8)])
def test_2bw_runs_one_version_behind_with_two_buffers(p: int, m: int) -> None:
    n = 4
    r = report("2bw", p, m, n)
    for k in range(p):
        assert r.weight_copies[k] == 2
        for t in range(n):
            for j in range(m):
                assert r.passes[(k, t * m + j)].forward_version == max(t - 1, 0)
            assert r.updates[(k, t)].staleness == (1 if t >= 1 else 0)


@pytest.mark.parametrize("method", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_flushed_methods_have_one_copy_and_no_staleness(method: str) -> None:
    r = report(method, 4, 4, 3)
    for k in r.stages:
        assert r.weight_copies[k] == 1
        assert r.max_staleness(k) == 0
        assert r.max_distance(k) == 0
        assert r.max_inconsistency(k) == 0


def test_activations_in_flight_1f1b_vs_gpipe() -> None:
    p, m = 4, 8
    assert report("1f1b", p, m, 2).max_in_flight == {k: p - k for k in range(p)}
    assert report("gpipe", p, m, 2).max_in_flight == dict.fromkeys(range(p), m)


def test_xpipe_predicts_the_mini_batch_update_target() -> None:
    p, m = 4, 4
    r = report("xpipe", p, m, 4)
    for k in range(p):
        for t in range(4):
            targets = {r.passes[(k, t * m + j)].forward_version for j in range(m)}
            assert targets == {t}  # every micro-batch of t stands for W^(t)
        assert r.weight_copies[k] == (1 if k == p - 1 else 2)


def test_prediction_offset() -> None:
    assert prediction_distance(2) == 2
    assert prediction_distance(2, offset=1) == 3
    assert prediction_distance(0, offset=-1) == 0
