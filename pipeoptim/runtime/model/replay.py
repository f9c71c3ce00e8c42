"""Whether a forward is a recomputation (activation recomputation runs a unit's forward again
inside its backward).

A unit whose forward has a side effect besides its output (recording a statistic, counting
calls) asks :func:`is_recomputing` to do it once per forward, as torchgpipe's
``is_recomputing`` lets a module do; the attention-logit recorder of QK-Clip does. The flag is a
context variable, so threads and the stages of one process do not see each other's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["is_recomputing", "recomputing"]

_RECOMPUTING: ContextVar[bool] = ContextVar("pipeoptim_recomputing", default=False)


def is_recomputing() -> bool:
    """True while a unit's forward runs again for its backward."""
    return _RECOMPUTING.get()


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the forwards run inside as recomputations."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)
