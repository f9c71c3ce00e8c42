"""How activations and gradients move between stages: one interface, two implementations.

The executor interprets the same lowered action list (``plan.passes.add_communication``)
whatever carries the tensors, so the single-process path and the multi-process path cannot
drift apart:

* :class:`LocalTransport`: every rank lives in one process on one device and a message is a
  dictionary entry. Deterministic, no threads; the fast path on CPU and on a single GPU.
* :class:`DistTransport`: one rank per process over ``torch.distributed`` point-to-point
  operations (gloo on CPU, NCCL on CUDA). Receives are posted early (``post_recv``, as the
  executor looks ahead) and waited late (at the ``RECV`` action), sends are asynchronous and
  reaped later, so communication overlaps compute.

A message is named by ``(kind, receiving stage, micro-batch)``; on gloo the name becomes the
message tag, so out-of-order posting is safe. A message may be a tuple of tensors (a stage
that hands on hidden states and a mask): the local mailbox stores the tuple, the distributed
transport sends each tensor as its own message, part ``i`` under the message's tag plus ``i``
times a stride that keeps every part's tags apart (:data:`MAX_PARTS` parts at most). NCCL
ignores tags and matches messages per pair of ranks in posting order, which holds for every
non-interleaved schedule (each directed pair carries one kind of message in micro-batch
order; the parts of a tuple are posted in order on both sides).
"""

from __future__ import annotations

import contextlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import Store

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.payload import MAX_PARTS, Payload
from pipeoptim.runtime.placement import stop_if_orphaned

__all__ = [
    "MAX_PARTS",
    "DistTransport",
    "FailureBoard",
    "LocalTransport",
    "MessageKey",
    "Parts",
    "PeerLostError",
    "Transport",
    "lost_peer",
]

MessageKey = tuple[str, int, int]
"""``(kind, receiving stage, micro-batch)``: kind ``act``, ``grad``, ``target`` (stage 0's rank
to the last stage's), ``eval`` / ``eval_target`` for evaluation batches, or ``tie`` (a weight
shared across stages: ``ties.py``)."""

_KINDS = {"act": 0, "grad": 1, "eval": 2, "target": 3, "eval_target": 4, "tie": 5}
_TAG_LIMIT = 2**30
_PART_STRIDE = _TAG_LIMIT // MAX_PARTS  # part i of a tuple: its message's tag + i x stride

Parts = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""The (shape, dtype) of each tensor of a tuple message, in order."""


class PeerLostError(RuntimeConfigError):
    """A peer rank stopped answering: it crashed, was killed, or stopped on an error."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class Transport(ABC):
    """Point-to-point messages between the ranks of one pipeline."""

    rank: int

    @abstractmethod
    def send(self, tensor: Payload, peer: int, key: MessageKey) -> None:
        """Send ``tensor`` (or a tuple of tensors) to rank ``peer``; returns without waiting
        for delivery."""

    @abstractmethod
    def recv(self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """The tensor named ``key`` from rank ``peer`` (blocks until it is there)."""

    @abstractmethod
    def recv_parts(self, key: MessageKey, peer: int, parts: Parts) -> tuple[Tensor, ...]:
        """The tuple of tensors named ``key`` from rank ``peer``, each of its ``parts``'
        shape and dtype (blocks until they are there)."""

    def post_recv_parts(  # noqa: B027 - optional hook, a no-op where receives are instant
        self, key: MessageKey, peer: int, parts: Parts
    ) -> None:
        """:meth:`post_recv` for a tuple message."""

    def post_recv(  # noqa: B027 - optional hook, a no-op where receives are instant
        self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        """Announce a receive ahead of time so it can progress during compute."""

    def ready(self, key: MessageKey) -> bool:
        """Whether ``recv(key)`` would return without waiting on another rank's progress."""
        return True

    @property
    def posts_receives(self) -> bool:
        """Whether posting a receive ahead does anything here (a transport that overrides
        :meth:`post_recv` or :meth:`post_recv_parts`); the executor announces receives only
        then, since finding them costs a look at the next actions after every action."""
        kind = type(self)
        return (
            kind.post_recv is not Transport.post_recv
            or kind.post_recv_parts is not Transport.post_recv_parts
        )

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Wait until every message sent so far has left."""


class LocalTransport(Transport):
    """All ranks in one process: a shared mailbox. Messages are copies, as over a wire, so a
    receiving stage can never write into a tensor the sending stage saved for backward."""

    def __init__(self, rank: int, mailbox: dict[MessageKey, Payload]) -> None:
        self.rank = rank
        self._mailbox = mailbox

    @classmethod
    def group(cls, world_size: int) -> list[LocalTransport]:
        """One endpoint per rank, sharing a mailbox."""
        mailbox: dict[MessageKey, Payload] = {}
        return [cls(r, mailbox) for r in range(world_size)]

    def send(self, tensor: Payload, peer: int, key: MessageKey) -> None:
        if key in self._mailbox:
            raise RuntimeError(f"rank {self.rank}: message {key} sent twice")
        # No copy: what is sent is a stage's detached output or an input gradient, which
        # the sender never writes again; the receiving stage makes an input a leaf that
        # requires grad, so an in-place op on it raises instead of changing the sender's.
        if isinstance(tensor, Tensor):
            self._mailbox[key] = tensor.detach()
        else:
            self._mailbox[key] = tuple(t.detach() for t in tensor)

    def ready(self, key: MessageKey) -> bool:
        return key in self._mailbox

    def _take(self, key: MessageKey, peer: int) -> Payload:
        try:
            return self._mailbox.pop(key)
        except KeyError:
            raise RuntimeError(
                f"rank {self.rank}: message {key} from rank {peer} was never sent"
            ) from None

    def recv(self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        t = self._take(key, peer)
        assert isinstance(t, Tensor), f"message {key} is a tuple"
        return t

    def recv_parts(self, key: MessageKey, peer: int, parts: Parts) -> tuple[Tensor, ...]:
        t = self._take(key, peer)
        assert isinstance(t, tuple), f"message {key} is one tensor, not a tuple"
        return t


class DistTransport(Transport):
    """One rank of a ``torch.distributed`` process group (already initialised).

    Waits are bounded by the process group's timeout; a peer that dies surfaces as
    :class:`PeerLostError` naming it (gloo notices a closed connection at once).
    """

    def __init__(
        self,
        rank: int,
        num_stages: int,
        device: torch.device,
        *,
        first_rank: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = rank
        self.device = device
        self._group = group
        """The process group the messages go over (None: the default one); peers are still
        addressed by their rank in the default group."""
        self._num_stages = num_stages
        self._first = first_rank
        """Process-group rank of this pipeline's rank 0 (replica x P under data parallelism):
        peers are named by pipeline rank, addressed by process-group rank."""
        self._recvs: dict[MessageKey, tuple[dist.Work, Tensor, int]] = {}
        self._part_recvs: dict[MessageKey, list[tuple[dist.Work, Tensor]]] = {}
        self._sends: list[tuple[dist.Work, Tensor, int, MessageKey]] = []

    def _tag(self, key: MessageKey) -> int:
        # Unique among the messages a pair of ranks has in flight; wraps on very long runs.
        kind, stage, mb = key
        return ((mb * self._num_stages + stage) * len(_KINDS) + _KINDS[kind]) % _TAG_LIMIT

    def send(self, tensor: Payload, peer: int, key: MessageKey) -> None:
        if not isinstance(tensor, Tensor):
            self._send_parts(tensor, peer, key)
            return
        buf = tensor.detach().contiguous()
        work = dist.isend(buf, self._first + peer, tag=self._tag(key), group=self._group)
        if work is None:  # pragma: no cover - only when this rank is not in the group
            raise RuntimeError(f"rank {self.rank}: isend to rank {peer} returned no work")
        self._sends.append((work, buf, peer, key))
        if len(self._sends) > 64:
            # Keep a long segment's send buffers bounded. Waiting on the oldest sends cannot
            # deadlock: in a valid schedule their receivers get there without any message
            # this rank has yet to send.
            self._wait_sends(self._sends[:32])
            del self._sends[:32]

    def _part_tags(self, key: MessageKey, n: int) -> list[int]:
        if n > MAX_PARTS:
            raise RuntimeError(f"{_describe(key)} has {n} tensors, over {MAX_PARTS}")
        tag = self._tag(key)
        return [(tag + i * _PART_STRIDE) % _TAG_LIMIT for i in range(n)]

    def _send_parts(self, tensors: tuple[Tensor, ...], peer: int, key: MessageKey) -> None:
        for t, tag in zip(tensors, self._part_tags(key, len(tensors)), strict=True):
            buf = t.detach().contiguous()
            work = dist.isend(buf, self._first + peer, tag=tag, group=self._group)
            if work is None:  # pragma: no cover
                raise RuntimeError(f"rank {self.rank}: isend to rank {peer} returned no work")
            self._sends.append((work, buf, peer, key))
        if len(self._sends) > 64:
            self._wait_sends(self._sends[:32])
            del self._sends[:32]

    def post_recv_parts(self, key: MessageKey, peer: int, parts: Parts) -> None:
        if key in self._part_recvs:
            return
        posted = []
        for (shape, dtype), tag in zip(parts, self._part_tags(key, len(parts)), strict=True):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, self._first + peer, tag=tag, group=self._group)
            if work is None:  # pragma: no cover
                raise RuntimeError(f"rank {self.rank}: irecv from rank {peer} returned no work")
            posted.append((work, buf))
        self._part_recvs[key] = posted

    def recv_parts(self, key: MessageKey, peer: int, parts: Parts) -> tuple[Tensor, ...]:
        self.post_recv_parts(key, peer, parts)
        what = f"{_describe(key)} from rank {self._first + peer}"
        out = []
        for i, (work, buf) in enumerate(self._part_recvs.pop(key)):
            self._wait(work, peer, f"tensor {i} of {what}")
            out.append(buf)
        return tuple(out)

    def post_recv(
        self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        if key in self._recvs:
            return
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        work = dist.irecv(buf, self._first + peer, tag=self._tag(key), group=self._group)
        if work is None:  # pragma: no cover
            raise RuntimeError(f"rank {self.rank}: irecv from rank {peer} returned no work")
        self._recvs[key] = (work, buf, peer)

    def recv(self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        self.post_recv(key, peer, shape, dtype)
        work, buf, _ = self._recvs.pop(key)
        self._wait(work, peer, f"{_describe(key)} from rank {self._first + peer}")
        return buf

    def flush(self) -> None:
        self._wait_sends(self._sends)
        self._sends = []

    def _wait_sends(self, sends: list[tuple[dist.Work, Tensor, int, MessageKey]]) -> None:
        for work, _, peer, key in sends:
            self._wait(work, peer, f"delivery of {_describe(key)} to rank {self._first + peer}")

    def _wait(self, work: dist.Work, peer: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as err:  # gloo/NCCL report a dead peer or a timeout this way
            stop_if_orphaned()  # the peer went because the launcher did: say that, and end
            lost = self._first + peer  # the process-group rank, as the launcher names ranks
            raise PeerLostError(
                f"lost rank {lost} while waiting for {what}: {_cause(err)}", lost
            ) from None


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
        return PeerLostError(f"lost a peer rank (it stopped or died): {_cause(err)}", -1)
    return None


def _cause(err: BaseException) -> str:
    """The backend's message without its source location and boilerplate."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]


def _describe(key: MessageKey) -> str:
    kind, stage, mb = key
    name = {
        "act": "the activation",
        "grad": "the gradient",
        "target": "the targets",
        "eval": "the evaluation batch",
        "eval_target": "the evaluation targets",
        "tie": "the shared-weight gradients",
    }[kind]
    return f"{name} of micro-batch {mb} for stage {stage}"


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
