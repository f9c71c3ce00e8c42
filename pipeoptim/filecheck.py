"""Checking the toolkit's JSON files with pydantic: the field types they share, and pydantic's
errors written as one message that names the file, the field, what was expected and what
was got.

Each file (plan, profile, stage graph, trace) is described by typed classes in its own
module (``TypedDict``s and dataclasses, e.g. :class:`pipeoptim.plan.plan.PlanFile`), which
pydantic validates before any object is built from them. So a wrong value gives ``plan.json:
field num_stages must be a whole number >= 1 (got "four"); <remedy>`` instead of a Python
error from deep inside a constructor. The types check shape, types and simple bounds; the
classes keep checking the rules between fields. What a field expects is read from the type's
JSON schema (a ``what`` entry, see :func:`what`, replaces the generated wording).

Rules every file follows:

- JSON has one number type, so a :data:`WholeNumber` takes ``4`` or ``4.0`` (and gets ``4``;
  a float must be below 2**63, where floats still hold whole numbers exactly) and a
  :data:`Number` takes any finite number; ``true``/``false`` are never numbers and numbers
  are never strings (strings and flags use pydantic's ``StrictStr`` and ``StrictBool``).
- An object allows unknown keys (``extra="allow"``: forward-compatible files; the keys are
  kept) or refuses them (``extra="forbid"``), as its class's config says.
- A file whose type declares a constant ``format`` is a *headed* file: a root that is not an
  object, a wrong ``format`` or an unknown ``version`` (a :class:`Whole` with ``one_of``) is
  reported first, with the type's config ``title`` as what the file should be: ``plan.json
  is not a pipeoptim plan (no "format": "pipeoptim-plan")``.

One message is reported per file: a header problem first, then the first one met reading the
file (in each object a missing key first, then the keys in the file's order).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import (
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import CoreSchema, core_schema

from pipeoptim.errors import PipeoptimError

__all__ = [
    "Finite",
    "IntKey",
    "NonNegativeNumber",
    "NonNegativeWhole",
    "Number",
    "PositiveWhole",
    "Whole",
    "WholeNumber",
    "check",
    "what",
]

T = TypeVar("T")

_FLOAT_MAX = int(sys.float_info.max)
INT_KEY_PATTERN = r"^-?[0-9]+$"
"""Object keys that are whole numbers written as strings (JSON keys are strings)."""


@dataclass(frozen=True)
class Whole:
    """``Annotated[int, Whole(...)]``: a whole number (``4`` or ``4.0``, never ``true``), at
    least ``ge`` and at most ``le`` where given, and one of ``one_of`` where given."""

    ge: int | None = None
    le: int | None = None
    one_of: tuple[int, ...] = ()

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        exact: CoreSchema = core_schema.int_schema(strict=True, ge=self.ge, le=self.le)
        # 4.0: a finite float, then pydantic's lax float-to-int (which refuses 4.5)
        from_float: CoreSchema = core_schema.chain_schema(
            [
                core_schema.float_schema(strict=True, allow_inf_nan=False),
                core_schema.int_schema(ge=self.ge, le=self.le),
            ]
        )
        if self.one_of:  # inside the union: one error whose input is as given (4.0, not 4)
            known = core_schema.literal_schema(list(self.one_of))
            exact = core_schema.chain_schema([exact, known])
            from_float = core_schema.chain_schema([from_float, known])
        return core_schema.union_schema(
            [exact, from_float],
            custom_error_type="pipeoptim_whole_number",
            custom_error_message="Input should be a whole number",
        )

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "integer"}
        if self.ge is not None:
            out["minimum"] = self.ge
        if self.le is not None:
            out["maximum"] = self.le
        if self.one_of:
            out["enum"] = list(self.one_of)
        return out


@dataclass(frozen=True)
class Finite:
    """``Annotated[float, Finite(...)]``: a finite number (never ``true``; an int no larger
    than a float holds), at least ``ge`` where given; it stays the int or float it was
    given."""

    ge: float | None = None

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.union_schema(
            [
                core_schema.int_schema(  # an int as large as a float can hold
                    strict=True,
                    ge=-_FLOAT_MAX if self.ge is None else math.ceil(self.ge),
                    le=_FLOAT_MAX,
                ),
                core_schema.float_schema(strict=True, allow_inf_nan=False, ge=self.ge),
            ],
            custom_error_type="pipeoptim_number",
            custom_error_message="Input should be a finite number",
        )

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "number"}
        if self.ge is not None:
            out["minimum"] = self.ge
        return out


WholeNumber = Annotated[int, Whole()]
PositiveWhole = Annotated[int, Whole(ge=1)]
NonNegativeWhole = Annotated[int, Whole(ge=0)]
Number = Annotated[float, Finite()]
NonNegativeNumber = Annotated[float, Finite(ge=0)]
IntKey = Annotated[str, StringConstraints(pattern=INT_KEY_PATTERN)]
"""A key of ``dict[IntKey, ...]``: a whole number written as a string (it stays a string)."""


def what(text: str) -> Any:
    """``Annotated[..., what("a list of [start, end] layer ranges")]``: the wording messages
    use for what the field expects."""
    return Field(json_schema_extra={"what": text})


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(tp: Any) -> TypeAdapter[Any]:
    """The adapter of a file type, built on first use (building costs milliseconds, so a
    command pays only for the files it reads)."""
    adapter = _ADAPTERS.get(tp)
    if adapter is None:
        adapter = _ADAPTERS[tp] = TypeAdapter(tp)
    return adapter


def check(
    tp: type[T],
    data: object,
    *,
    source: str,
    remedy: str,
    error: type[PipeoptimError] = PipeoptimError,
) -> T:
    """``data`` validated as ``tp`` (whole numbers normalised); else ``error`` with
    ``source<what is wrong>; remedy``."""
    adapter: TypeAdapter[T] = _adapter(tp)
    try:
        return adapter.validate_python(data)
    except ValidationError as err:
        raise error(f"{message(tp, data, err, source)}; {remedy}") from None


def message(tp: Any, data: object, err: ValidationError, source: str) -> str:
    """The one-line message for ``err`` from validating ``data``, read from ``source``, as
    a ``tp``."""
    root = _adapter(tp).json_schema()
    defs: dict[str, Any] = root.get("$defs", {})
    format_ = root.get("properties", {}).get("format", {})
    headed = "const" in format_
    first = min(err.errors(include_url=False), key=lambda e: _order(e["loc"], headed, data))
    loc, kind, got = first["loc"], first["type"], first.get("input")
    title = root.get("title", "file")
    if headed and not loc:
        return f"{source} must be a JSON object (a {title}), got {_shown(got)}"
    if headed and loc == ("format",):
        return f'{source} is not a {title} (no "format": {json.dumps(format_["const"])})'
    if headed and loc == ("version",) and kind != "missing":
        version = _at(root, "version", defs) or {}
        known = ", ".join(str(v) for v in version.get("enum", ()))
        return f"{source} has version {_shown(got)}; this pipeoptim reads {title} version {known}"
    if kind == "missing":
        return f"{source}{_where(loc[:-1], ': ')} is missing the key {loc[-1]!r}"
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        parent = _node(root, loc[:-1], defs) or {}
        valid = ", ".join(_resolve(parent, defs).get("properties", {}))
        return f"{source}: {_field(loc[:-1])} has the unknown key {loc[-1]!r}; valid keys: {valid}"
    if loc and loc[-1] == "[key]":
        return (
            f"{source}: {_field(loc[:-2])} has the key {loc[-2]!r}; its keys must be whole numbers"
        )
    node = _node(root, loc, defs)
    expected = _describe(node, defs) if node is not None else "valid"
    return f"{source}: {_field(loc)} must be {expected} (got {_shown(got)})"


def _order(loc: tuple[int | str, ...], headed: bool, data: object) -> tuple[int, list[int]]:
    """Which error to report: the root's, then a header's, then the one met first reading
    the file (in each object a missing key first, then the keys in the file's order)."""
    rank = (
        0
        if not loc
        else 1
        if headed and loc == ("format",)
        else 2
        if headed and loc == ("version",)
        else 3
    )
    where: list[int] = []
    node = data
    for key in loc:
        if isinstance(node, dict):
            where.append(list(node).index(key) if key in node else -1)
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            where.append(key)
            node = node[key]
        else:
            where.append(0)
            node = None
    return rank, where


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for key in loc:
        out = f"{out}[{key}]" if isinstance(key, int) else (f"{out}.{key}" if out else key)
    return out


def _where(loc: tuple[int | str, ...], sep: str) -> str:
    return f"{sep}{_path(loc)}" if loc else ""


def _field(loc: tuple[int | str, ...]) -> str:
    return f"field {_path(loc)}" if loc else "it"


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------- reading the JSON schema
def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _at(node: dict[str, Any], key: int | str, defs: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of ``node``'s item or value at ``key`` (through a nullable's value)."""
    node = _resolve(node, defs)
    options = [o for o in node.get("anyOf", ()) if o.get("type") != "null"]
    if len(options) == 1:
        node = _resolve(options[0], defs)
    if isinstance(key, int):
        items = node.get("items")
        return items if isinstance(items, dict) else None
    if key in node.get("properties", {}):
        sub: dict[str, Any] = node["properties"][key]
        return sub
    for sub in node.get("patternProperties", {}).values():
        return sub
    extra = node.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _node(
    root: dict[str, Any], loc: tuple[int | str, ...], defs: dict[str, Any]
) -> dict[str, Any] | None:
    node: dict[str, Any] | None = root
    for key in loc:
        if node is None:
            return None
        node = _at(node, key, defs)
    return node


def _describe(node: dict[str, Any], defs: dict[str, Any]) -> str:
    """What a value of schema ``node`` is, in words: "a whole number >= 1 or null"."""
    node = _resolve(node, defs)
    if "what" in node:
        return str(node["what"])
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        text = " or ".join(_describe(o, defs) for o in options)
        return f"{text} or null" if len(options) < len(node["anyOf"]) else text
    if "const" in node:
        return json.dumps(node["const"])
    kind = node.get("type")
    if kind == "integer":
        low, high = node.get("minimum"), node.get("maximum")
        text = "a whole number" + (f" >= {low}" if low is not None else "")
        return (
            text
            + (" and" if low is not None and high is not None else "")
            + (f" <= {high:,}" if high is not None else "")
        )
    if kind == "number":
        low = node.get("minimum")
        return "a number" + (f" >= {low:g}" if low is not None else "")
    if kind == "string":
        return "a string"
    if kind == "boolean":
        return "true or false"
    if kind == "array":
        items = node.get("items")
        if not items:
            return "a list"
        size = node.get("minItems")
        count = f"{size} items" if size is not None and size == node.get("maxItems") else "items"
        return f"a list of {count}, each {_describe(items, defs)}"
    if kind == "object":
        patterns = node.get("patternProperties", {})
        keys = " keyed by whole numbers" if INT_KEY_PATTERN in patterns else ""
        values = next(iter(patterns.values()), node.get("additionalProperties"))
        if "properties" in node or not isinstance(values, dict) or not values:
            return f"an object{keys}"
        return f"an object{keys} whose values are each {_describe(values, defs)}"
    return "a value"
