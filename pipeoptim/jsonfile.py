"""Reading the toolkit's JSON files (plans, profiles, traces) with one set of clear errors.

Every input file the toolkit reads (plans, profiles, traces, CSV schedules) goes through
:func:`read_text`, so the one limit on input files, :data:`MAX_INPUT_BYTES`, is checked
here, with the reading. This module imports nothing from the rest of pipeoptim but its
errors: ``pipeoptim.plan`` reads its files through it, and ``tests/test_layering.py`` keeps
it free of the plan so that no import circle can close through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeoptim.errors import PipeoptimError, WorkLimitError

__all__ = ["MAX_INPUT_BYTES", "check_input_size", "read_json", "read_text"]

MAX_INPUT_BYTES = 1 << 30
"""The largest input file read: 1 GiB, twice the size of the largest trace a simulation
within the default limits writes (``pipeoptim.plan.limits.MAX_ACTIONS`` events, about
0.5 GB of JSON)."""


def _size(num_bytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:.0f} B"


def check_input_size(path: str, num_bytes: int, what: str) -> None:
    """Refuse to read an input file larger than ``MAX_INPUT_BYTES``."""
    if num_bytes > MAX_INPUT_BYTES:
        raise WorkLimitError(
            f"{what} {path!r} is {_size(num_bytes)}; the limit for an input file is "
            f"{_size(MAX_INPUT_BYTES)} (the largest trace a simulation within the default "
            f"limits writes is about 0.5 GB). Fix: write a smaller run (fewer --mini-batches) "
            f"or check that this is the right file"
        )


def read_text(
    path: str | Path, *, what: str, remedy: str, error: type[PipeoptimError] = PipeoptimError
) -> str:
    """The UTF-8 text of ``path``; a missing, unreadable, oversized (``MAX_INPUT_BYTES``) or
    binary file raises ``error`` whose message names the file and ends with ``remedy``."""
    file = Path(path)
    try:
        check_input_size(str(file), file.stat().st_size, what)
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(
            f"cannot read {what} {str(file)!r}: the file does not exist; {remedy}"
        ) from None
    except UnicodeDecodeError:
        raise error(f"{what} {str(file)!r} is not UTF-8 text; {remedy}") from None
    except OSError as err:
        raise error(f"cannot read {what} {str(file)!r}: {err.strerror or err}; {remedy}") from None


def read_json(
    path: str | Path, *, what: str, remedy: str, error: type[PipeoptimError] = PipeoptimError
) -> Any:
    """Parse ``path``; a missing, unreadable, empty or malformed file raises ``error`` whose
    message names the file, says what is wrong and ends with ``remedy``."""
    file = Path(path)
    text = read_text(file, what=what, remedy=remedy, error=error)
    if not text.strip():
        raise error(f"{what} {str(file)!r} is empty; {remedy}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(
            f"{what} {str(file)!r} is not valid JSON ({err.msg} at line {err.lineno} column "
            f"{err.colno}); {remedy}"
        ) from None
    except RecursionError:
        raise error(f"{what} {str(file)!r} is nested too deeply to be one; {remedy}") from None
