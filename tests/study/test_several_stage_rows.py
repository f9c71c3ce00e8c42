"""The convergence study's rows of the synchronous methods that place several stages on
every rank equal gpipe's row: the same updates (a flush, one weight version, the same
micro-batches), so the same losses. Bitwise: the local runtime sums each parameter's
micro-batch gradients in the same order whatever the placement."""

from __future__ import annotations

import pytest

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.study.grid import ALL_METHODS, StudyConfig, with_methods
from pipeoptim.study.runs import RunSpec, run_one

SEVERAL = ("dualpipev", "interleaved-zb")


def test_the_study_takes_them_when_named_and_not_by_default() -> None:
    config = with_methods(
        StudyConfig("mlp", steps=4, eval_every=2), "gpipe, dualpipev,interleaved-zb"
    )
    assert config.methods == ("gpipe", *SEVERAL)
    assert not set(SEVERAL) & set(ALL_METHODS)
    with pytest.raises(RuntimeConfigError, match="unknown method"):
        with_methods(config, "gpipe,dualpipe")
    with pytest.raises(RuntimeConfigError, match="names no method"):
        with_methods(config, " , ")


def test_their_rows_equal_gpipes() -> None:
    def row(method: str) -> list[tuple[float, float, float]]:
        spec = RunSpec("mlp", method, "sgd", 0.5, 2, 0, 4, 2, batch_size=16, eval_samples=64)
        return [(p.train_loss, p.test_loss, p.test_metric) for p in run_one(spec).curve]

    gpipe = row("gpipe")
    assert len(gpipe) == 2 and gpipe[0] != gpipe[1]  # it trained
    for method in SEVERAL:
        assert row(method) == gpipe, method
