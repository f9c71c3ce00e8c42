"""Human-readable byte and bandwidth quantities.

The planner takes memory caps and link bandwidths from people ("8GiB", "25GB/s") and prints
them back in messages, so parsing and formatting live in one small module with one set of
rules:

* ``KiB MiB GiB TiB`` are binary (1024-based); ``KB MB GB TB`` are decimal (1000-based).
* A bare prefix without ``B`` (``8G``, ``512m``) is binary, as in ``java -Xmx`` and docker.
* For bandwidths a lower-case ``b`` / ``bit`` / ``bps`` means bits (``100Gb/s``, ``100Gbps``);
  an upper-case ``B`` means bytes. Results are always bytes per second.
* Plain numbers are bytes (or bytes per second).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from pipeoptim.errors import PlanError

__all__ = ["format_bandwidth", "format_bytes", "parse_bandwidth", "parse_bytes"]

_PREFIX_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}

_QUANTITY = re.compile(
    r"""^\s*
    (?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*
    (?P<prefix>[kKmMgGtTpP]?)
    (?P<binary>i?)
    (?P<unit>bytes|byte|bits|bit|B|b|)
    (?P<rate>/s|/sec|ps)?
    \s*$""",
    re.VERBOSE,
)

_BYTES_EXAMPLES = "write e.g. '8GiB', '512MiB', '16GB', '8G' or a plain number of bytes"
_BANDWIDTH_EXAMPLES = "write e.g. '25GB/s', '12.5GiB/s', '100Gb/s', '100Gbps' or bytes per second"


def _scale(prefix: str, binary: bool) -> int:
    power = _PREFIX_POWER[prefix.lower()]
    base = 1024 if binary else 1000
    return int(base**power)


def parse_bytes(text: str | int | float) -> int:
    """Parse a memory size such as ``"8GiB"``, ``"16GB"``, ``"8G"`` or ``"1024"`` into bytes.

    Numbers pass through (rounded down to whole bytes). Raises :class:`PlanError` on anything
    else, on bits, on per-second units and on negative or non-finite values.
    """
    if isinstance(text, bool):
        raise PlanError(
            f"a byte size must be a number or a string, got {text!r}; {_BYTES_EXAMPLES}"
        )
    if isinstance(text, (int, float)):
        if not math.isfinite(text) or text < 0:
            raise PlanError(
                f"a byte size must be a finite number >= 0, got {text!r}; {_BYTES_EXAMPLES}"
            )
        return int(text)
    match = _QUANTITY.match(text)
    if match is None:
        raise PlanError(f"cannot read {text!r} as a byte size; {_BYTES_EXAMPLES}")
    unit, rate = match["unit"], match["rate"]
    if rate is not None:
        raise PlanError(
            f"{text!r} is a bandwidth (per second), not a byte size; drop the '{rate}' "
            f"({_BYTES_EXAMPLES})"
        )
    if unit in ("b", "bit", "bits"):
        raise PlanError(
            f"{text!r} is in bits; memory sizes are in bytes: write '{match['num']}"
            f"{match['prefix'].upper()}{match['binary']}B' for bytes ({_BYTES_EXAMPLES})"
        )
    binary = bool(match["binary"]) or (match["prefix"] != "" and unit == "")
    value = float(match["num"]) * _scale(match["prefix"], binary)
    if not math.isfinite(value):
        raise PlanError(f"{text!r} is too large to be a byte size; {_BYTES_EXAMPLES}")
    return int(value)


def parse_bandwidth(text: str | int | float) -> float:
    """Parse a link bandwidth such as ``"25GB/s"`` or ``"100Gbps"`` into bytes per second.

    Numbers pass through as bytes per second. The value must be positive (use ``inf`` in code
    for "communication is free").
    """
    if isinstance(text, bool):
        raise PlanError(f"a bandwidth must be a number or a string, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _QUANTITY.match(text)
        if match is None:
            raise PlanError(f"cannot read {text!r} as a bandwidth; {_BANDWIDTH_EXAMPLES}")
        prefix, unit, rate = match["prefix"], match["unit"], match["rate"]
        if rate is None and (prefix or unit):
            raise PlanError(
                f"{text!r} has no per-second unit; a bandwidth is an amount per second: "
                f"write '{text.strip()}/s' ({_BANDWIDTH_EXAMPLES})"
            )
        bits = unit in ("b", "bit", "bits") or (unit == "" and rate == "ps")
        value = float(match["num"]) * _scale(prefix, bool(match["binary"]))
        if bits:
            value /= 8.0
    if math.isnan(value) or value <= 0:
        raise PlanError(
            f"a bandwidth must be > 0 bytes per second, got {text!r}; {_BANDWIDTH_EXAMPLES}"
        )
    return value


def format_bytes(num_bytes: float, *, round_up: bool = False) -> str:
    """Format a byte count with a binary unit: ``format_bytes(3 * 2**29) == "1.50 GiB"``.

    With ``round_up`` the two-decimal figure is rounded up, so "at least X" in a message is
    never below the true value.
    """
    value = float(num_bytes)
    if not math.isfinite(value):
        return str(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024.0 or unit == "TiB":
            break
        value /= 1024.0
    if unit == "B":
        return f"{int(num_bytes) if float(num_bytes).is_integer() else num_bytes} B"
    if round_up:
        value = math.ceil(value * 100.0 - 1e-9) / 100.0
    return f"{value:.2f} {unit}"


def format_bandwidth(bytes_per_s: float) -> str:
    """Format bytes per second with decimal units, the way links are sold: ``"25.00 GB/s"``."""
    value = float(bytes_per_s)
    if not math.isfinite(value):
        return f"{value} B/s"
    for unit in ("B/s", "KB/s", "MB/s", "GB/s", "TB/s"):
        if abs(value) < 1000.0 or unit == "TB/s":
            break
        value /= 1000.0
    return f"{value:.2f} {unit}"


def format_distances(values: Sequence[int]) -> str:
    """Per-stage values run-length coded: ``7,6,5,4,3,2,1,0``, ``1x7,0``, ``2x63,1``, ``0``
    (prediction distances, weight copies)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    if len(runs) == 1:
        return str(runs[0][0])
    return ",".join(str(v) if n == 1 else f"{v}x{n}" for v, n in runs)
