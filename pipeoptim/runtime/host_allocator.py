"""The host allocator of a process that trains on the CPU: keep freed memory for the next
step rather than handing it back to the operating system.

Why: every training step frees and allocates the same buffers again (activations, received
messages, gradients, the optimizer's temporaries; a megabyte and more for most layers).
glibc's malloc serves a block above its mmap threshold with fresh pages and gives the top
of its heap back once more than its trim threshold lies free there, so each step pays page
faults and the zeroing of pages for memory it had just given back. A pipeline's ranks keep
more buffers in flight than a plain loop over the same layers, and pay more: on a 2-core
machine, with these settings every run of ``benchmarks/bench_runtime.py`` got faster, and
the asynchronous methods moved closer to the limit (``benchmarks/README.md``).

What it costs: up to :data:`TRIM_THRESHOLD` bytes of freed memory stay in the process, and
blocks under :data:`MMAP_THRESHOLD` come from the heap, where freed space is reused rather
than unmapped. Nothing else changes; a run computes bit for bit what it did.

A setting the user made through glibc's own variables (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``) stands: where either is set, this module sets neither.
Elsewhere than glibc (macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["ENV_VARIABLES", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "applied", "keep_freed_memory"]

MMAP_THRESHOLD = 32 << 20
"""Bytes from which a block gets pages of its own (glibc's largest allowed on 64-bit)."""
TRIM_THRESHOLD = 256 << 20
"""Bytes free at the heap's top before glibc gives them back."""
ENV_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""glibc's own variables for the two settings; a user who set either keeps theirs."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_applied: dict[str, int] = {}
"""What this process set (the allocator is the process's, so the record is too)."""


def keep_freed_memory() -> dict[str, int]:
    """Raise glibc's mmap and trim thresholds in this process; return what is set
    (``{"mmap_threshold": ..., "trim_threshold": ...}``), or ``{}`` where nothing was: not
    glibc, or the user set one of :data:`ENV_VARIABLES`. Idempotent."""
    if _applied:
        return dict(_applied)
    if platform.libc_ver()[0] != "glibc" or any(v in os.environ for v in ENV_VARIABLES):
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the trim threshold first: setting the mmap threshold alone would leave glibc's
    # dynamic trim rule (twice the mmap threshold) in force until then
    if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        _applied.update(mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)
    return dict(_applied)


def applied() -> dict[str, int]:
    """What :func:`keep_freed_memory` set in this process (``{}``: nothing)."""
    return dict(_applied)
