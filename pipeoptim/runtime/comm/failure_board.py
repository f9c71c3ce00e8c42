"""Which rank failed first, and why: failure notices between the ranks of one run, and the
backend's reports of a peer that went away read as :class:`~pipeoptim.errors.PeerLostError`."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from pipeoptim.errors import PeerLostError
from pipeoptim.runtime.comm.parent_watch import stop_if_orphaned

__all__ = ["FailureBoard", "backend_cause", "lost_peer"]

_LOST = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|"
    r"remote process exited|communicator was aborted",
    re.IGNORECASE,
)


def lost_peer(err: BaseException) -> PeerLostError | None:
    """``err`` as a :class:`PeerLostError` when it is the backend's report of a peer that
    went away outside the transport's waits (a collective while the run starts, a barrier),
    else None. Which rank went is not in the message (gloo names a port): the peer is -1,
    and the launcher, which sees its children exit, names it."""
    stop_if_orphaned()  # the peer went because the launcher did: say that, and end
    if isinstance(err, PeerLostError):
        return err
    network = getattr(dist, "DistNetworkError", None)
    if (network is not None and isinstance(err, network)) or (
        isinstance(err, RuntimeError) and _LOST.search(str(err))
    ):
        return PeerLostError(f"lost a peer rank (it stopped or died): {backend_cause(err)}", -1)
    return None


def backend_cause(err: BaseException) -> str:
    """The backend's message without its source location and boilerplate."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]


class FailureBoard:
    """Failure notices between the ranks of one run, kept in the process group's store.

    The first rank (or launcher) to post wins, so the record names the rank that failed
    first and why; the others read it to report the cause instead of a bare "connection
    closed". A store that is gone reads as no record.
    """

    KEY = "pipeoptim/abort"

    def __init__(self, store: Store) -> None:
        self.store = store

    def post(self, rank: int, kind: str, message: str, **extra: Any) -> None:
        """``kind``: error, nonfinite, peer (lost a peer: ``suspect``), died (launcher)."""
        record = {"rank": rank, "kind": kind, "message": message, **extra}
        text = json.dumps(record)
        with contextlib.suppress(RuntimeError):
            held = self.store.compare_set(self.KEY, "", text).decode()
            # Two ranks can each find a non-finite value at their own step (the last stage's
            # loss, stage 0's weights at the next checkpoint), in either order: the earliest
            # step is the cause, the later one its consequence, so it replaces a later one.
            while held != text and kind == "nonfinite":
                first = json.loads(held)
                if first.get("kind") != "nonfinite" or int(first["step"]) <= int(extra["step"]):
                    break
                held = self.store.compare_set(self.KEY, held, text).decode()

    def read(self) -> dict[str, Any] | None:
        try:
            if self.store.check([self.KEY]):
                record: dict[str, Any] = json.loads(self.store.get(self.KEY))
                return record
        except (RuntimeError, ValueError):
            return None
        return None

    def check(self) -> None:
        """Raise :class:`PeerLostError` if another rank has failed."""
        record = self.read()
        if record is not None:
            rank = int(record.get("suspect", record["rank"]))
            raise PeerLostError(f"rank {rank} failed ({record['message']})", rank)
