"""Reading the toolkit's JSON files (plans, profiles, traces) with one set of clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.limits import check_input_size


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
