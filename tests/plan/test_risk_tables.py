"""The study's measured tables as package data: read once, written exactly, refused with the
key and the fix when malformed, and copied (not shared) by the risk model's constants."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan import risk
from pipeoptim.plan.risk_tables import (
    CURVES,
    GAIN_DELAY,
    OPTIONAL_TABLES,
    TABLES,
    packaged_path,
    packaged_risk_tables,
    read_risk_tables,
    risk_tables_from_json,
    risk_tables_json,
)


def packaged_json() -> dict[str, object]:
    loaded = json.loads(packaged_path().read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def test_the_package_holds_every_table_and_reads_it_once() -> None:
    tables = packaged_risk_tables()
    assert packaged_risk_tables() is tables  # cached: one read per process
    assert tables.kappa["adamw"] == 0.3817
    assert tables.closure[("optimizer", "adamw")][25] == 0.0
    assert math.copysign(1.0, tables.closure[("optimizer", "adamw")][25]) == -1.0  # -0.0 kept
    assert tables.depth_copies[8]["pipedream"] == 8
    assert list(tables.depth_excess) == [4, 8, 16, 32]
    assert tables.meta["not_derived"] == []
    assert set(tables.meta["derived_from_committed_results"]) == {
        *TABLES,
        *OPTIONAL_TABLES,
        CURVES,
        GAIN_DELAY,
    }
    assert tables.depth_speed[8]["xpipe"] > 1  # simulated faster than zb-h1 there


def test_the_file_is_exactly_what_the_writer_writes() -> None:
    """Reading then writing gives the committed text back: key order (the risk model's ties
    go to the first row) and every float's digits survive."""
    text = packaged_path().read_text(encoding="utf-8")
    assert risk_tables_json(packaged_risk_tables()) == text
    again = risk_tables_from_json(json.loads(text))
    assert again == packaged_risk_tables()


def test_the_risk_constants_are_the_tables_as_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = packaged_risk_tables()
    assert tables.closure == risk.CLOSURE and tables.kappa == risk.KAPPA
    assert tables.correction_gain == risk.CORRECTION_GAIN
    assert tables.depth_excess == risk.DEPTH_EXCESS
    assert tables.depth_copies == risk.DEPTH_COPIES
    assert tables.depth_excess_first == risk.DEPTH_EXCESS_FIRST
    assert tables.depth_speed == risk.DEPTH_SPEED
    assert tables.depth_equal_time == risk.DEPTH_EQUAL_TIME
    assert tables.risk_curve == risk.RISK_CURVE
    assert tables.correction_gain_delay == risk.CORRECTION_GAIN_DELAY
    monkeypatch.setitem(risk.KAPPA, "adamw", 9.0)
    monkeypatch.setitem(risk.DEPTH_EXCESS[8], "pipeoptim", 9.0)
    assert tables.kappa["adamw"] == 0.3817  # a test's change stays in the risk module
    assert tables.depth_excess[8]["pipeoptim"] == 0.517


def test_a_file_without_the_time_tables_loads_them_empty_and_writes_them_back_absent() -> None:
    """A table file written before the study measured time (no ``depth_speed``, no
    ``depth_equal_time``) still loads, and is written back as it was."""
    data = packaged_json()
    for name in OPTIONAL_TABLES:
        del data[name]
    tables = risk_tables_from_json(data)
    assert tables.depth_speed == {} and tables.depth_equal_time == {}
    assert tables.depth_excess == packaged_risk_tables().depth_excess
    assert json.loads(risk_tables_json(tables)) == data


def test_a_file_without_a_table_is_refused_naming_it_and_the_fix() -> None:
    data = packaged_json()
    del data["depth_copies"]
    with pytest.raises(PlanError, match=r"lacks the tables \['depth_copies'\].*--report-only"):
        risk_tables_from_json(data)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("kappa", "adamw"), "0.37", r"kappa\['adamw'\] must be a finite number \(got '0.37'\)"),
        (("kappa", "sgd"), math.nan, r"kappa\['sgd'\] must be a finite number \(got nan\)"),
        (
            ("depth_copies", "8", "gpipe"),
            1.5,
            r"depth_copies\['8'\]\['gpipe'\] must be an integer >= 0 \(got 1.5\)",
        ),
        (("depth_excess", "8"), [0.1], r"depth_excess\['8'\] must be a JSON object"),
        (("closure", "xpipe"), {"sgd": {"one": 0.7}}, r"keys of closure\['xpipe'\]\['sgd'\]"),
        (
            ("correction_gain_delay", "extrapolate/muon"),
            -1,
            r"correction_gain_delay\['extrapolate/muon'\] must be an integer >= 0 \(got -1\)",
        ),
        (
            ("risk_curve", "adamw"),
            [[1.0]],
            r"risk_curve\['adamw'\] holds \[1.0\], not an \[e, extra\]",
        ),
        (("risk_curve", "muon"), [[2.0, 0.5], [1.0, 0.6]], r"e increasing.*refit"),
    ],
)
def test_a_bad_value_is_refused_with_its_key(
    path: tuple[str, ...], value: object, message: str
) -> None:
    data = packaged_json()
    holder: Any = data
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    with pytest.raises(PlanError, match=message):
        risk_tables_from_json(data)


def test_a_missing_file_names_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"risk tables .*does not exist; regenerate it"):
        read_risk_tables(tmp_path / "risk_tables.json")
