"""The file checks: pydantic validation with the toolkit's number rules and its messages
(file, field, expected, got), and the file types that mirror the classes they build."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal

import pytest
from pydantic import ConfigDict, StrictStr, TypeAdapter, with_config
from typing_extensions import Required, TypedDict

from pipeoptim.errors import PipeoptimError, PlanError
from pipeoptim.filecheck import (
    IntKey,
    NonNegativeNumber,
    NonNegativeWhole,
    Number,
    PositiveWhole,
    Whole,
    WholeNumber,
    check,
    what,
)
from pipeoptim.plan.graph import StageFile, StageGraphFile, stage_graph, stage_graph_to_dict
from pipeoptim.plan.plan import PLAN_FORMAT, OptimizerFile, OptimizerSpec, Plan, PlanFile
from pipeoptim.plan.profile import PROFILE_FORMAT, LayerFile, LayerProfile, Profile, ProfileFile
from pipeoptim.trace import TRACE_FORMAT, Trace, TraceEvent, TraceFile


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class Point:
    x: WholeNumber
    y: Number = 0.0


@with_config(ConfigDict(extra="allow"))
class Inner(TypedDict, total=False):
    count: Required[PositiveWhole]
    size: NonNegativeWhole
    seconds: NonNegativeNumber | None
    ranges: Annotated[list[list[NonNegativeWhole]], what("a list of ranges")] | None
    by_rank: dict[IntKey, WholeNumber]
    big: Annotated[int, Whole(ge=0, le=1 << 40)]


@with_config(ConfigDict(title="test file", extra="allow"))
class Doc(TypedDict, total=False):
    format: Required[Literal["test-file"]]
    version: Annotated[int, Whole(one_of=(1, 2))]
    name: StrictStr
    inner: Required[Inner]
    points: list[Point]


def ok(**fields: Any) -> dict[str, Any]:
    return {"format": "test-file", "version": 1, "inner": {"count": 1}, **fields}


def problem(data: object) -> str:
    with pytest.raises(PipeoptimError) as info:
        check(Doc, data, source="doc.json", remedy="fix it")
    text = str(info.value)
    assert text.endswith("; fix it"), text
    return text.removesuffix("; fix it")


# --------------------------------------------------------------------------- numbers
def test_whole_numbers_take_ints_and_whole_floats() -> None:
    got = check(Doc, ok(inner={"count": 4.0, "size": 0, "big": 3.0}), source="s", remedy="r")
    assert got["inner"] == {"count": 4, "size": 0, "big": 3}
    assert all(type(v) is int for v in got["inner"].values())
    assert check(Doc, ok(points=[{"x": -2.0}]), source="s", remedy="r")["points"] == [
        Point(-2, 0.0)
    ]


@pytest.mark.parametrize(
    ("count", "shown"),
    [
        ("four", '"four"'),
        ("4", '"4"'),
        (True, "true"),
        (False, "false"),
        (4.5, "4.5"),
        (0, "0"),
        (-1.0, "-1.0"),
        (float("nan"), "NaN"),
        (float("inf"), "Infinity"),
        (1e300, "1e+300"),
        (None, "null"),
        ([4], "a list"),
        ({"n": 4}, "an object"),
        ("x" * 60, '"' + "x" * 36 + "..."),
    ],
)
def test_whole_numbers_refuse_the_rest(count: object, shown: str) -> None:
    assert problem(ok(inner={"count": count})) == (
        f"doc.json: field inner.count must be a whole number >= 1 (got {shown})"
    )


def test_bounds_are_named() -> None:
    assert problem(ok(inner={"count": 1, "big": 1 << 41})) == (
        "doc.json: field inner.big must be a whole number >= 0 and <= 1,099,511,627,776 "
        "(got 2199023255552)"
    )


def test_numbers_stay_as_given_and_refuse_flags_text_and_non_finite() -> None:
    got = check(Doc, ok(points=[{"x": 1, "y": 2}, {"x": 1, "y": 2.5}]), source="s", remedy="r")
    assert [type(p.y) for p in got["points"]] == [int, float]
    for bad, shown in ((True, "true"), ("1", '"1"'), (float("nan"), "NaN"), (10**400, None)):
        text = problem(ok(points=[{"x": 1, "y": bad}]))
        assert text.startswith("doc.json: field points[0].y must be a number (got "), text
        if shown:
            assert text.endswith(f"(got {shown})")
    assert problem(ok(inner={"count": 1, "seconds": -0.5})) == (
        "doc.json: field inner.seconds must be a number >= 0 or null (got -0.5)"
    )


def test_strings_are_strict() -> None:
    assert problem(ok(name=3)) == "doc.json: field name must be a string (got 3)"
    assert problem(ok(name=b"x")).startswith("doc.json: field name must be a string (got ")


# --------------------------------------------------------------------------- shapes
def test_nested_paths_and_containers() -> None:
    assert problem(ok(points=[{"x": 1}, 7])) == (
        "doc.json: field points[1] must be an object (got 7)"
    )
    assert problem(ok(points={})) == (
        "doc.json: field points must be a list of items, each an object (got an object)"
    )
    assert problem(ok(inner={"count": 1, "ranges": [[0, "a"]]})) == (
        'doc.json: field inner.ranges[0][1] must be a whole number >= 0 (got "a")'
    )
    assert problem(ok(inner={"count": 1, "ranges": 5})) == (
        "doc.json: field inner.ranges must be a list of ranges or null (got 5)"
    )
    assert problem(ok(inner=[])) == "doc.json: field inner must be an object (got a list)"


def test_whole_number_keys() -> None:
    data = ok(inner={"count": 1, "by_rank": {"0": 1, "-2": 3}})
    assert check(Doc, data, source="s", remedy="r")["inner"]["by_rank"] == {"0": 1, "-2": 3}
    assert problem(ok(inner={"count": 1, "by_rank": {"one": 1}})) == (
        "doc.json: field inner.by_rank has the key 'one'; its keys must be whole numbers"
    )
    assert problem(ok(inner={"count": 1, "by_rank": {"1": 1.5}})) == (
        "doc.json: field inner.by_rank.1 must be a whole number (got 1.5)"
    )


def test_unknown_keys_are_kept_or_refused_per_class() -> None:
    got = check(Doc, ok(extra=[1], inner={"count": 1, "note": "x"}), source="s", remedy="r")
    assert got["extra"] == [1] and got["inner"]["note"] == "x"
    assert problem(ok(points=[{"x": 1, "z": 2}])) == (
        "doc.json: field points[0] has the unknown key 'z'; valid keys: x, y"
    )


def test_missing_keys() -> None:
    assert problem({"format": "test-file"}) == "doc.json is missing the key 'inner'"
    assert problem(ok(inner={})) == "doc.json: inner is missing the key 'count'"
    assert problem(ok(points=[{}])) == "doc.json: points[0] is missing the key 'x'"


# --------------------------------------------------------------------------- header
def test_header_problems_come_first_and_name_the_file_type() -> None:
    assert problem([1]) == "doc.json must be a JSON object (a test file), got a list"
    assert problem({"inner": 3}) == 'doc.json is not a test file (no "format": "test-file")'
    assert problem(ok(format="other", inner=3)) == (
        'doc.json is not a test file (no "format": "test-file")'
    )
    for version, shown in ((3, "3"), (True, "true"), (3.0, "3.0"), ("1", '"1"')):
        assert problem(ok(version=version, inner=3)) == (
            f"doc.json has version {shown}; this pipeoptim reads test file version 1, 2"
        )
    assert check(Doc, ok(version=2.0), source="s", remedy="r")["version"] == 2


def test_the_first_problem_reading_the_file_is_reported() -> None:
    """In each object a missing key first, then the keys in the file's order."""
    data: dict[str, Any] = {"format": "test-file", "points": [{"x": "a"}], "inner": {}}
    assert problem(data) == 'doc.json: field points[0].x must be a whole number (got "a")'
    data = {"format": "test-file", "inner": {"size": -1}, "points": [{"x": "a"}]}
    assert problem(data) == "doc.json: inner is missing the key 'count'"
    data["inner"] = {"count": 1, "size": -1}
    assert problem(data) == "doc.json: field inner.size must be a whole number >= 0 (got -1)"
    del data["inner"]
    assert problem(data) == "doc.json is missing the key 'inner'"


def test_the_error_type_is_the_callers() -> None:
    with pytest.raises(PlanError, match=r"doc.json is missing the key 'inner'; r$"):
        check(Doc, {"format": "test-file"}, source="doc.json", remedy="r", error=PlanError)


# --------------------------------------------------------------------------- file types
def test_file_types_mirror_the_classes_they_build() -> None:
    header = {"format", "version"}
    assert set(PlanFile.__annotations__) == {f.name for f in fields(Plan)} | header
    assert set(OptimizerFile.__annotations__) == {f.name for f in fields(OptimizerSpec)}
    assert set(LayerFile.__annotations__) == {f.name for f in fields(LayerProfile)}
    assert set(ProfileFile.__annotations__) == {f.name for f in fields(Profile)} | header
    assert set(TraceFile.__annotations__) == {f.name for f in fields(Trace)} | header
    assert (PLAN_FORMAT, PROFILE_FORMAT, TRACE_FORMAT) == (
        "pipeoptim-plan",
        "pipeoptim.profile",
        "pipeoptim-trace",
    )
    for tp, fmt in (
        (PlanFile, PLAN_FORMAT),
        (ProfileFile, PROFILE_FORMAT),
        (TraceFile, TRACE_FORMAT),
    ):
        assert TypeAdapter(tp).json_schema()["properties"]["format"]["const"] == fmt


def test_stage_file_keeps_the_order_stage_graph_writes() -> None:
    profile = Profile.uniform(4, activation_bytes=10, param_bytes=100)
    # a profile that measured the prediction's per-update setup writes it; one that did not,
    # leaves it out (the field is optional)
    measured = dataclasses.replace(
        profile,
        layers=[dataclasses.replace(x, prediction_setup_s=0.001) for x in profile.layers],
    )
    for source, optional in ((measured, set()), (profile, {"prediction_setup_s"})):
        data = stage_graph_to_dict(stage_graph(source, [(0, 2), (2, 4)]))
        keys = list(data["stages"][0])
        assert [k for k in StageFile.__annotations__ if k not in optional] == keys
        checked = check(StageGraphFile, data, source="s", remedy="r")
        assert [list(s) for s in checked["stages"]] == [list(s) for s in data["stages"]]


def test_trace_events_are_built_by_the_check() -> None:
    data = {
        "format": "pipeoptim-trace",
        "meta": {"z": 1, "method": "gpipe", "a": 2},
        "events": [{"rank": 0, "stage": 0, "kind": "F", "mb": 1.0, "start": 0, "end": 0.5}],
    }
    trace = Trace.from_dict(data)
    assert trace.events == [TraceEvent(0, 0, "F", 1, 0, 0.5)]
    assert type(trace.events[0].mb) is int
    assert list(trace.meta) == ["z", "method", "a"]  # the file's order


def test_file_types_have_a_json_schema() -> None:
    schema = TypeAdapter(PlanFile).json_schema()
    assert schema["title"] == "pipeoptim plan"
    assert schema["required"] == ["format", "method", "num_stages"]
    assert schema["properties"]["num_stages"]["type"] == "integer"
    assert schema["properties"]["num_stages"]["minimum"] == 1
