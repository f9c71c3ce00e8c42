"""Optimizer columns with settings of their family (``study/variants.py``): ``nadam β1=0.99``
is AsyncPP's NAdam. A row under it builds NAdam with that β1, is judged against gpipe under
the same setting, costs what NAdam costs, and stays out of the planner's tables."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.study.cells import aggregate, synchronous_label
from pipeoptim.study.grid import StudyConfig, main_specs, relative_cost
from pipeoptim.study.risk_fit import RiskFitParts
from pipeoptim.study.runs import CurvePoint, RunRecord, RunSpec, run_one
from pipeoptim.study.targets import row_optimizers
from pipeoptim.study.variants import family_of, is_variant, optimizer_options

ASYNCPP = "nadam β1=0.99"

CONFIG = StudyConfig(
    "gpt-deep",
    steps=8,
    eval_every=4,
    methods=("gpipe", "xpipe"),
    optimizers=("adamw",),
    stages=(4,),
    sweep_stages=4,
    seeds=1,
    rates={"adamw": (2e-3,)},
    high_rate=False,
    pairs=(("gpipe", "nadam"), ("xpipe", "nadam"), ("gpipe", ASYNCPP), ("xpipe", ASYNCPP)),
)


def test_a_setting_in_the_name_is_an_option_of_the_family() -> None:
    assert optimizer_options(ASYNCPP) == ("nadam", {"beta1": 0.99})
    assert optimizer_options("adamw β1=0.8 β2=0.95") == ("adamw", {"beta1": 0.8, "beta2": 0.95})
    assert optimizer_options("muon") == ("muon", {})
    assert family_of(ASYNCPP) == "nadam" and family_of("muon") == "muon"
    assert is_variant(ASYNCPP) and not is_variant("nadam") and not is_variant(None)


@pytest.mark.parametrize("name", ["nadam beta1=0.99", "nadam β1=", "nadam β1=high", "nadam β3=1"])
def test_a_setting_that_cannot_be_read_is_refused_with_the_form(name: str) -> None:
    with pytest.raises(RuntimeConfigError, match=r"write a family and settings as 'nadam β1=0.99'"):
        optimizer_options(name)


def test_a_pair_under_an_unknown_family_or_setting_is_refused() -> None:
    with pytest.raises(RuntimeConfigError, match="names no optimizer family"):
        StudyConfig("gpt-deep", steps=8, eval_every=4, pairs=(("gpipe", "nadamw β1=0.9"),))
    with pytest.raises(RuntimeConfigError, match="cannot read the setting"):
        StudyConfig("gpt-deep", steps=8, eval_every=4, pairs=(("gpipe", "nadam b1=0.9"),))


def test_the_row_is_judged_against_gpipe_under_the_same_setting() -> None:
    labels = [s.label for s in main_specs(CONFIG, {"adamw": (2e-3, None)})]
    assert {"gpipe (nadam)", f"gpipe ({ASYNCPP})", f"xpipe ({ASYNCPP})"} <= set(labels)
    assert synchronous_label(f"xpipe ({ASYNCPP})") == f"gpipe ({ASYNCPP})"
    assert synchronous_label(f"xpipe ({ASYNCPP})", "zb-h1") == f"zb-h1 ({ASYNCPP})"


def test_it_costs_and_is_simulated_as_its_family() -> None:
    assert row_optimizers(CONFIG) == ["nadam"]  # one profile for both NAdam columns
    spec = RunSpec("gpt-deep", "xpipe", "adamw", 2e-3, 4, 0, 8, 4, trained_optimizer=ASYNCPP)
    nadam = RunSpec("gpt-deep", "xpipe", "adamw", 2e-3, 4, 0, 8, 4, trained_optimizer="nadam")
    assert relative_cost(spec) == relative_cost(nadam)
    assert spec.key != nadam.key


def test_a_run_builds_the_family_with_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    built: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def pipeline(*args: Any, **kwargs: Any) -> None:
        built.update(kwargs)
        raise Stop

    monkeypatch.setattr("pipeoptim.runtime.pipeline.Pipeline", pipeline)
    spec = RunSpec(
        "mlp", "xpipe", "adamw", 1e-3, 2, 0, 4, 2, trained_optimizer=ASYNCPP, weight_decay=0.01
    )
    with pytest.raises(Stop):
        run_one(spec)
    optimizer = built["optimizer"]
    assert optimizer.family == "nadam" and optimizer.lr == 1e-3
    assert optimizer.options == {
        "beta1": 0.99,
        "weight_decay": 0.01,
        "decoupled_weight_decay": True,
    }


def _record(method: str, optimizer: str, loss: float) -> RunRecord:
    spec = RunSpec("gpt-deep", method, "adamw", 2e-3, 4, 0, 8, 4, trained_optimizer=optimizer)
    return RunRecord(spec, [CurvePoint(8, 256, loss, math.exp(loss), loss)], None, 1.0)


def test_its_rows_stay_out_of_the_planners_tables() -> None:
    """The tables are keyed by family: a row under a setting would be read as its family's."""
    records = [
        _record("gpipe", "nadam", 2.0),
        _record("xpipe", "nadam", 2.1),
        _record("gpipe", ASYNCPP, 2.0),
        _record("xpipe", ASYNCPP, 2.4),
    ]
    parts = RiskFitParts()
    parts.add_model(CONFIG, aggregate(records), {"adamw": (2e-3, None)}, {}, [])
    assert parts.depth_excess[4] == {
        "gpipe (nadam)": 0.0,
        "xpipe (nadam)": pytest.approx(0.05),
    }
