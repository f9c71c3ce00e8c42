"""A rank that outlives its launcher ends: the watchdog, and the torch-free start of a
spawned rank that installs it before anything heavy is imported.

:func:`exit_with_parent` watches the launcher and ends this process within half a second
of its death, with one line. Why polling ``os.getppid()`` and not
``prctl(PR_SET_PDEATHSIG)``: the death signal follows the parent *thread* that forked (not
the process), needs Linux and ctypes, and a SIGTERM handler in Python runs only on the main
thread between bytecodes, so a rank blocked in a gloo or NCCL wait would not print or exit;
the daemon thread wakes every half second, works wherever Python does, runs while the main
thread waits in C++ (which releases the GIL), writes its line and ends the process.

The ``pipeoptim train`` launcher starts each rank as ``python -m
pipeoptim.runtime.comm.parent_watch WORKER``: the watchdog is on before ``WORKER`` (and
torch, seconds of imports on a loaded machine) loads, so a launcher killed while its ranks
are still importing takes them down within the same half second. This module imports
nothing beyond the standard library.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from typing import Any

__all__ = ["exit_with_parent", "orphan_line", "stop_if_orphaned", "write_whole_line"]

LAUNCHER_PID = "PIPEOPTIM_LAUNCHER_PID"
"""The environment variable a spawned rank finds its launcher's pid in."""

_watched: dict[int, str] = {}
"""Launcher pid -> the line to write when it is gone (a script may build several Pipelines)."""


def orphan_line(rank: int) -> str:
    """What rank ``rank`` of ``pipeoptim train`` says as it stops for a dead launcher."""
    return f"pipeoptim train: rank {rank}: the launching process is gone; stopping"


def exit_with_parent(parent: int, line: str, period: float = 0.5) -> None:
    """Stop this process within ``period`` seconds of the death of its launcher, process
    ``parent``, after writing ``line`` to stderr; exit status 1, no traceback, no cleanup
    (the peers see this rank's connections close, as for any dead rank). A launcher that
    died before this call is noticed too, when ``parent`` is the pid it gave its children.
    Installed once per launcher pid.

    The first rank to notice ends, and its peers see it go (a lost peer) before their own
    next poll: :func:`stop_if_orphaned`, which the transport calls on a lost peer and the
    exception hook on an uncaught error, makes them end with the same line, not with an
    error about the peer or a traceback."""
    if parent in _watched:
        return
    first = not _watched
    _watched[parent] = line

    def watch() -> None:
        while True:
            stop_if_orphaned()
            time.sleep(period)

    threading.Thread(target=watch, name="pipeoptim-parent-watch", daemon=True).start()
    if first:
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            stop_if_orphaned()
            previous(kind, value, tb)

        sys.excepthook = hook


def stop_if_orphaned() -> None:
    """End this process now, with its watchdog's line and exit status 1, if a launcher it
    watches (:func:`exit_with_parent`) is gone; else return."""
    for parent, text in list(_watched.items()):
        if os.getppid() != parent:
            # no flush: the main thread, blocked mid-write, may hold the stream's lock
            write_whole_line(text, flush_first=False)
            os._exit(1)


def write_whole_line(text: str, *, flush_first: bool = True) -> None:
    """Write ``text`` and its newline to stderr in one write. The ranks of one run share
    their launcher's stderr and print at the same moment when one of them dies; Python's
    unbuffered stderr (not a terminal) gives ``print`` one write for the text and one for
    the newline, so two ranks' lines ran together (``...by peerpipeoptim train: rank 2``).
    ``flush_first``: flush ``sys.stderr`` before, so what this rank wrote there before
    stays before."""
    line = text.rstrip("\n") + "\n"
    if flush_first:
        sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a notebook's stream has no descriptor
        sys.stderr.write(line)
        sys.stderr.flush()
        return
    data = line.encode(errors="backslashreplace")
    while data:  # a pipe takes up to PIPE_BUF (4 KiB) at once, atomically
        data = data[os.write(fd, data) :]


def main(argv: list[str]) -> None:
    """``python -m pipeoptim.runtime.comm.parent_watch WORKER``: watch the launcher named by
    ``PIPEOPTIM_LAUNCHER_PID`` (this rank's ``RANK`` in the line), then run module
    ``WORKER`` as ``__main__``."""
    if len(argv) != 1:
        sys.exit(
            "usage: python -m pipeoptim.runtime.comm.parent_watch WORKER_MODULE (one module; "
            f"got {argv}); the pipeoptim train launcher starts its ranks this way"
        )
    if __spec__ is not None and __name__ == "__main__":
        # the worker's own import of this module gets this copy: one watchdog, one line
        sys.modules.setdefault(__spec__.name, sys.modules[__name__])
    exit_with_parent(int(os.environ[LAUNCHER_PID]), orphan_line(int(os.environ["RANK"])))
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
