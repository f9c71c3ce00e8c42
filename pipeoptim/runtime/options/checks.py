"""The ranges and the whole-number test that the options' checks share, torch-free.

Why apart from the groups: ``runtime/config.py`` (``pipeoptim train``'s configuration, which
takes its shared options' defaults and checks from the groups) and the groups both use them,
and neither may import the other's module first.
"""

from __future__ import annotations

from pipeoptim.errors import RuntimeConfigError

__all__ = ["AMP_MODES", "MAX_SEED", "MAX_TIMEOUT", "check_whole", "is_whole"]

AMP_MODES = ("bf16", "fp16")

MAX_SEED = 2**32 - 1
"""Seeds go up to this: per-stage and per-epoch seeds derived from it must fit in 64 bits."""

MAX_TIMEOUT = 1e9
"""Seconds a rank may wait for another at most (about 31 years): the process group holds
its timeout as a ``timedelta``, which overflows past about 8.6e13 s (and at infinity)."""


def is_whole(value: object, minimum: int | None = 0, maximum: int | None = None) -> bool:
    """``value`` is a whole number (an ``int``, not a ``bool``) in ``minimum..maximum`` (None:
    unbounded): the one test behind every count the runtime takes (its callers word their
    own errors)."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (minimum is None or minimum <= value)
        and (maximum is None or value <= maximum)
    )


def check_whole(name: str, value: object, *, minimum: int = 1, example: str = "") -> int:
    """``value`` as a whole number >= ``minimum``, or the error naming ``name`` (a library
    argument) and an ``example`` of a good value."""
    if not is_whole(value, minimum):
        fix = f"; e.g. {example}" if example else ""
        raise RuntimeConfigError(f"{name} must be a whole number >= {minimum} (got {value!r}){fix}")
    assert isinstance(value, int)  # is_whole said so; for the type checker
    return value
