"""Small helpers the sub-commands share: JSON output, tables, argument checks, output files.

Output files follow one rule, so a finished result is never lost to a bad path:

1. :func:`check_output_paths` runs first, before any work: every ``--out``/``--html``/
   ``--trace``... path must be a file whose folder exists and is writable, else the command
   stops with an :class:`OutputPathError` naming the flag, the path and the fix.
2. :class:`ResultFiles` writes the files at the end. A write that still fails (disk full,
   folder removed meanwhile) is recorded, not raised: the command prints its results as
   usual, then :meth:`ResultFiles.finish` says ``not written: PATH (reason)`` on stderr and
   returns exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeoptim.errors import OutputPathError, PipeoptimError

__all__ = [
    "ResultFiles",
    "add_json_flag",
    "check_number",
    "check_output_path",
    "check_output_paths",
    "format_table",
    "print_json",
]


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON instead of text"
    )


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Text left-aligned, numeric columns right-aligned; floats with 4 significant digits."""

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    text = [[cell(v) for v in row] for row in rows]
    numeric = [
        all(isinstance(row[i], (int, float)) for row in rows) if rows else False
        for i in range(len(headers))
    ]
    widths = [max([len(h)] + [len(r[i]) for r in text]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if numeric[i] else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, text)])


# --------------------------------------------------------------------------- arguments
def check_number(
    flag: str,
    value: float | None,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    example: str,
) -> None:
    """Refuse a non-finite ``value`` or one outside ``[minimum, maximum]`` (or not above
    ``above``), naming the flag: ``--latency must be >= 0 seconds (got -1); e.g. ...``."""
    if value is None:
        return
    rules = []
    if minimum is not None:
        rules.append(f">= {minimum:g}")
    if above is not None:
        rules.append(f"> {above:g}")
    if maximum is not None:
        rules.append(f"<= {maximum:g}")
    bad = (
        not math.isfinite(value)
        or (minimum is not None and value < minimum)
        or (above is not None and value <= above)
        or (maximum is not None and value > maximum)
    )
    if bad:
        raise PipeoptimError(
            f"{flag} must be a number {' and '.join(rules)} (got {value:g}); e.g. {flag} {example}"
        )


# --------------------------------------------------------------------------- output files
def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def check_output_path(flag: str, path: str | Path) -> None:
    """Refuse an output path that cannot be written, before any work is done: a folder, a
    path whose folder is missing or not a folder, or one that is not writable."""
    text = str(path)
    p = Path(path)
    parent = p.parent
    try:
        if text.strip() == "" or p.is_dir():
            raise OutputPathError(
                f"{flag} {text!r} is a folder, not a file; give a file path, e.g. "
                f"{flag} {p / 'FILE'}"
            )
        if not parent.exists():
            raise OutputPathError(
                f"{flag} {text!r}: the folder {str(parent)!r} does not exist; create it "
                f"(mkdir -p {parent}) or choose another path"
            )
        if not parent.is_dir():
            raise OutputPathError(
                f"{flag} {text!r}: {str(parent)!r} is a file, not a folder; choose another path"
            )
        if p.exists() and not os.access(p, os.W_OK):
            raise OutputPathError(
                f"{flag} {text!r} exists and is not writable; choose another path or "
                f"change its permissions"
            )
        if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
            raise OutputPathError(
                f"{flag} {text!r}: the folder {str(parent)!r} is not writable; choose "
                f"another folder"
            )
    except OSError as err:
        raise OutputPathError(
            f"{flag} {text!r} cannot be used as an output file ({err.strerror or err}); "
            f"choose another path"
        ) from None


def check_output_paths(
    args: argparse.Namespace, flags: Sequence[str], *, inputs: Sequence[str] = ()
) -> None:
    """Check every output flag of ``flags`` (e.g. ``["--out", "--html"]``) that ``args``
    sets, with :func:`check_output_path`; refuse two flags naming one file, and an output
    that would overwrite one of the ``inputs`` flags' files (e.g. ``["--trace"]``).

    Call it first in a command, before loading inputs or doing any work."""
    seen: dict[Path, str] = {}
    for flag in inputs:
        value = getattr(args, _dest(flag), None)
        if value is not None:
            seen[Path(value).absolute()] = f"the input {flag}"
    for flag in flags:
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        check_output_path(flag, value)
        key = Path(value).absolute()
        if key in seen and seen[key].startswith("the input"):
            raise OutputPathError(
                f"{flag} {str(value)!r} would overwrite {seen[key]}; choose another path"
            )
        if key in seen:
            raise OutputPathError(
                f"{seen[key]} and {flag} both write {str(value)!r}; give each its own file"
            )
        seen[key] = flag


class ResultFiles:
    """Writes a command's result files once the work is done, never losing the results.

    ``write(path, writer)`` calls ``writer(path)``; an :class:`OSError` is recorded instead
    of raised, so the command still prints what it computed. ``finish(command)`` then prints
    ``pipeoptim COMMAND: not written: PATH (reason)`` on stderr for each failure and returns
    the exit status: 0, or 2 when anything was not written.
    """

    def __init__(self) -> None:
        self.written: list[str] = []
        self.failed: list[str] = []

    def write(self, path: str | Path, writer: Callable[[Path], object]) -> bool:
        try:
            writer(Path(path))
        except OSError as err:
            self.failed.append(f"{path} ({err.strerror or err})")
            return False
        self.written.append(str(path))
        return True

    @property
    def ok(self) -> bool:
        return not self.failed

    def finish(self, command: str) -> int:
        for item in self.failed:
            print(f"pipeoptim {command}: not written: {item}", file=sys.stderr)
        return 2 if self.failed else 0
