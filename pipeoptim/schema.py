"""One small schema language for the toolkit's JSON files: plans, profiles and traces.

A file is checked against its schema before any object is built from it, so a wrong value
gives one error that names the file, the field and what was expected (``plan.json: field
num_stages must be a whole number >= 1 (got "four")``) instead of a Python error from deep
inside a constructor. The schema checks shape and types (and simple lower bounds); the
classes keep checking the rules between fields.

JSON has one number type, so a whole-number field takes ``4`` or ``4.0`` (and gets ``4``);
``true``/``false`` are never numbers. Objects may allow unknown keys (forward-compatible
files) or refuse them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeoptim.errors import PipeoptimError

__all__ = [
    "AnyValue",
    "Bool",
    "Dict",
    "Int",
    "List",
    "Num",
    "Obj",
    "Opt",
    "Spec",
    "Str",
    "check_header",
    "validate",
]


_PATH = "\x00"
"""Stands for the field's path in a message until the path is known."""


class _Mismatch(Exception):
    """Internal: where the data breaks the schema. Containers add their key on the way up,
    so the hot path builds no path strings; :func:`validate` writes the message."""

    def __init__(self, template: str) -> None:
        super().__init__(template)
        self.template = template
        self.keys: list[str | int] = []

    def at(self, key: str | int) -> _Mismatch:
        self.keys.append(key)
        return self

    @property
    def path(self) -> str:
        out = ""
        for key in reversed(self.keys):
            out = f"{out}[{key}]" if isinstance(key, int) else (f"{out}.{key}" if out else key)
        return out


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Spec:
    """A value's expected shape; ``what`` overrides the description in messages."""

    what: str = field(default="", kw_only=True)

    def describe(self) -> str:
        return self.what or self._describe()

    def _describe(self) -> str:
        return "a value"

    def check(self, value: Any) -> Any:
        """The value (whole numbers normalised to int), or :class:`_Mismatch`."""
        return value

    def fail(self, value: Any) -> _Mismatch:
        return _Mismatch(f"field {_PATH} must be {self.describe()} (got {_shown(value)})")


@dataclass(frozen=True)
class AnyValue(Spec):
    """Anything JSON holds."""


@dataclass(frozen=True)
class Int(Spec):
    """A whole number (``4`` or ``4.0``), at least ``minimum`` and at most ``maximum``."""

    minimum: int | None = None
    maximum: int | None = None

    def _describe(self) -> str:
        low = f" >= {self.minimum}" if self.minimum is not None else ""
        high = f" <= {self.maximum:,}" if self.maximum is not None else ""
        return "a whole number" + low + (" and" if low and high else "") + high

    def check(self, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(value)
        if (self.minimum is not None and value < self.minimum) or (
            self.maximum is not None and value > self.maximum
        ):
            raise self.fail(value)
        return value


@dataclass(frozen=True)
class Num(Spec):
    """A finite number, at least ``minimum``."""

    minimum: float | None = None

    def _describe(self) -> str:
        return "a number" + (f" >= {self.minimum:g}" if self.minimum is not None else "")

    def check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(value)
        if not math.isfinite(value) or (self.minimum is not None and value < self.minimum):
            raise self.fail(value)
        return value


@dataclass(frozen=True)
class Str(Spec):
    """A string."""

    def _describe(self) -> str:
        return "a string"

    def check(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise self.fail(value)
        return value


@dataclass(frozen=True)
class Bool(Spec):
    """``true`` or ``false``."""

    def _describe(self) -> str:
        return "true or false"

    def check(self, value: Any) -> Any:
        if not isinstance(value, bool):
            raise self.fail(value)
        return value


@dataclass(frozen=True)
class Opt(Spec):
    """``null`` or ``inner``."""

    inner: Spec = field(default_factory=AnyValue)

    def _describe(self) -> str:
        return f"{self.inner.describe()} or null"

    def check(self, value: Any) -> Any:
        if value is None:
            return None
        try:
            return self.inner.check(value)
        except _Mismatch as err:
            if not err.keys and err.template.startswith(f"field {_PATH} must be"):
                raise self.fail(value) from None
            raise


@dataclass(frozen=True)
class List(Spec):
    """A list of ``item`` (of exactly ``length`` items where given)."""

    item: Spec = field(default_factory=AnyValue)
    length: int | None = None

    def _describe(self) -> str:
        if isinstance(self.item, AnyValue):
            return "a list"
        count = f"{self.length} items" if self.length is not None else "items"
        return f"a list of {count}, each {self.item.describe()}"

    def check(self, value: Any) -> Any:
        if not isinstance(value, list) or (self.length is not None and len(value) != self.length):
            raise self.fail(value)
        if isinstance(self.item, AnyValue):
            return value
        check, out = self.item.check, []
        for i, v in enumerate(value):
            try:
                out.append(check(v))
            except _Mismatch as err:
                raise err.at(i) from None
        return out


@dataclass(frozen=True)
class Dict(Spec):
    """An object with any keys (whole numbers written as strings, with ``int_keys``) and
    values of ``value``."""

    value: Spec = field(default_factory=AnyValue)
    int_keys: bool = False

    def _describe(self) -> str:
        keys = " keyed by whole numbers" if self.int_keys else ""
        if isinstance(self.value, AnyValue):
            return f"an object{keys}"
        return f"an object{keys} whose values are each {self.value.describe()}"

    def check(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise self.fail(value)
        out = {}
        for k, v in value.items():
            if self.int_keys and not _is_int_text(k):
                raise _Mismatch(f"field {_PATH} has the key {k!r}; its keys must be whole numbers")
            try:
                out[k] = self.value.check(v)
            except _Mismatch as err:
                raise err.at(k) from None
        return out


@dataclass(frozen=True)
class Obj(Spec):
    """An object with known fields; ``required`` names those that must be present, and
    unknown keys are refused unless ``extra``."""

    fields: Mapping[str, Spec] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    extra: bool = True

    def _describe(self) -> str:
        return "an object"

    def check(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise self.fail(value)
        for name in self.required:
            if name not in value:
                raise _Mismatch(f"{_PATH} is missing the key {name!r}")
        out = dict(value)
        get = self.fields.get
        for name, v in value.items():
            spec = get(name)
            if spec is not None:
                try:
                    out[name] = spec.check(v)
                except _Mismatch as err:
                    raise err.at(name) from None
            elif not self.extra:
                raise _Mismatch(
                    f"field {_PATH} has the unknown key {name!r}; valid keys: "
                    + ", ".join(self.fields)
                )
        return out


def _is_int_text(key: str) -> bool:
    return key.lstrip("-").isdigit()


def validate(
    data: Any,
    spec: Spec,
    *,
    source: str,
    remedy: str,
    error: type[PipeoptimError] = PipeoptimError,
) -> Any:
    """``data`` checked against ``spec`` (whole numbers normalised); else ``error`` with
    ``source: <what is wrong>; remedy``."""
    try:
        return spec.check(data)
    except _Mismatch as err:
        path, message = err.path, err.template
        if not path and message.startswith(_PATH):  # the file itself: "x.json is missing..."
            raise error(f"{source}{message[1:]}; {remedy}") from None
        if not path:
            message = message.replace(f"field {_PATH} ", "it ")
        raise error(f"{source}: {message.replace(_PATH, path)}; {remedy}") from None
    except RecursionError:
        raise error(f"{source} is nested too deeply; {remedy}") from None


def check_header(
    data: Any,
    *,
    fmt: str,
    versions: tuple[int, ...],
    source: str,
    what: str,
    remedy: str,
    error: type[PipeoptimError] = PipeoptimError,
    format_required: bool = True,
    version_required: bool = False,
) -> None:
    """The file is an object with ``"format": fmt`` and a known ``"version"``."""
    if not isinstance(data, dict):
        raise error(f"{source} must be a JSON object (a {what}), got {_shown(data)}; {remedy}")
    got = data.get("format", None if format_required else fmt)
    if got != fmt:
        raise error(f'{source} is not a {what} (no "format": "{fmt}"); {remedy}')
    if "version" not in data:
        if version_required:
            raise error(f"{source} is missing the key 'version'; {remedy}")
        return
    version = data["version"]
    if isinstance(version, bool) or version not in versions:
        known = ", ".join(str(v) for v in versions)
        raise error(
            f"{source} has version {_shown(version)}; this pipeoptim reads {what} version "
            f"{known}; {remedy}"
        )
