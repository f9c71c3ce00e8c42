"""PipeOptim's dial: asynchronous 1F1B with M micro-batches per update, M from 1 up.

The expected tables are written out by hand from the schedule, not computed by the code
under test. Rank k of asynchronous 1F1B runs ``w = P-1-k`` warm-up forwards, then for every
micro-batch i the group ``F(i+w), B(i)`` and, after a mini-batch's last backward, its
update. So F(i) runs just before B(i-w), and between F(i) and B(i) come the updates after
B(i-w) ... B(i-1) that end a mini-batch: micro-batch j of a mini-batch meets
``s = ⌈(w-j)/M⌉`` updates (0 for j >= w), and the stage's delay (its first micro-batch's)
is ``τ_k = ⌈w/M⌉``: P-1-k at M = 1, one update at M >= P-1.
"""

from __future__ import annotations

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.plan.versions import analyze_order, steady_delays

P = 4
N = 12  # mini-batches: the steady state from mini-batch P-1 on; 8 is well inside it

# M -> per stage: the steady delay τ_k, and the prediction distance of each micro-batch j
TABLES: dict[int, dict[int, tuple[int, list[int]]]] = {
    1: {0: (3, [3]), 1: (2, [2]), 2: (1, [1]), 3: (0, [0])},
    2: {0: (2, [2, 1]), 1: (1, [1, 1]), 2: (1, [1, 0]), 3: (0, [0, 0])},
    4: {0: (1, [1, 1, 1, 0]), 1: (1, [1, 1, 0, 0]), 2: (1, [1, 0, 0, 0]), 3: (0, [0, 0, 0, 0])},
}


def test_pipeoptim_runs_whole_mini_batches_unless_asked() -> None:
    spec = get_method("pipeoptim")
    assert spec.shape(P).micro_batches == 1
    assert spec.micro_batches_for(None) == 1 and spec.default_micro_batches_at(P) == 1
    assert spec.shape(P, 2).micro_batches == 2 and spec.shape(P, 8).micro_batches == 8
    assert get_method("xpipe").shape(P).micro_batches == P  # the others keep M = P


@pytest.mark.parametrize("name", ["pipeoptim+pipemare", "pipeoptim+nesterov", "pipeoptim+shrink"])
def test_methods_built_on_pipeoptim_keep_its_dial(name: str) -> None:
    spec = METHODS[name]
    assert spec.shape(P).micro_batches == 1 and spec.shape(P, 2).micro_batches == 2


def test_the_bounded_delay_stays_whole_mini_batches() -> None:
    spec = get_method("pipeoptim+bounded")
    assert spec.shape(P).micro_batches == 1
    with pytest.raises(PlanError, match=r"runs each mini-batch as one unit \(got 2 micro-batches"):
        spec.shape(P, 2)


@pytest.mark.parametrize("m", sorted(TABLES))
def test_steady_delays_and_distances_per_micro_batch(m: int) -> None:
    spec = get_method("pipeoptim")
    shape = spec.shape(P, m, N)
    report = analyze_order(spec.order_arrays(shape), spec.version_rule, m)
    t = 8
    assert steady_delays(spec, shape) == {k: tau for k, (tau, _) in TABLES[m].items()}
    for k, (_, distances) in TABLES[m].items():
        passes = [report.passes[(k, t * m + j)] for j in range(m)]
        assert [v.distance for v in passes] == distances
        # every micro-batch predicts the version its mini-batch's backward meets, W^(t),
        # from the live weights of its forward, s updates earlier
        assert [v.forward_version for v in passes] == [t] * m
        assert [v.backward_version for v in passes] == [t] * m
        assert [v.forward_base for v in passes] == [t - s for s in distances]
        assert [v.predicted for v in passes] == [s > 0 for s in distances]
        assert report.distance(k, t) == max(distances)


@pytest.mark.parametrize("m", sorted(TABLES))
def test_memory_at_every_m(m: int) -> None:
    """Weight copies: the live weights and one prediction buffer (the last stage predicts
    nothing); activations: P-k micro-batches in flight on stage k at every M (each slot is
    a micro-batch, B/M samples, so the activations held fall as 1/M)."""
    spec = get_method("pipeoptim")
    shape = spec.shape(P, m, N)
    report = analyze_order(spec.order_arrays(shape), spec.version_rule, m)
    assert report.weight_copies == {0: 2, 1: 2, 2: 2, 3: 1}
    assert report.max_in_flight == {0: 4, 1: 3, 2: 2, 3: 1}
    factors = method_memory_factors("pipeoptim", P, m)
    assert [factors(k, P) for k in range(P)] == [(2, 4), (2, 3), (2, 2), (1, 1)]


def test_m_at_p_is_xpipes_schedule_with_pipeoptims_own_rule() -> None:
    dial, xpipe = get_method("pipeoptim"), get_method("xpipe")
    a, b = dial.order_arrays(dial.shape(P, P, N)), xpipe.order_arrays(xpipe.shape(P, P, N))
    assert (a.stage == b.stage).all() and (a.kind == b.kind).all() and (a.mb == b.mb).all()
    assert (dial.predictor, xpipe.predictor) == ("optimizer", "xpipe")
