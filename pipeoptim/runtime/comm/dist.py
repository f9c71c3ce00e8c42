"""The multi-process transport: one rank per process over ``torch.distributed``.

Point-to-point operations (gloo on CPU, NCCL on CUDA). Receives are posted early
(``post_recv``, as the executor looks ahead) and waited late (at the ``RECV`` action), sends
are asynchronous and reaped later, so communication overlaps compute.

How a receive finds its send: by default on gloo a message's name becomes its tag, so
out-of-order posting is safe; a tuple message sends each tensor as its own message, part
``i`` under the message's tag plus ``i`` times a stride that keeps every part's tags apart.
NCCL ignores tags and matches a pair's messages in posting order, per direction; so over
NCCL, and on gloo with ``one_tag`` (every message under tag 0, which makes gloo match as NCCL
does), the transport is *ordered*: the executor hands it, per sending rank, the receives in
the order that rank posts its sends (:meth:`expect`, computed from the schedule on both
ends: ``rank_messages.RankMessages.agreed_order``), and a receive posts every receive before
it in that order first, each into its own buffer. The parts of a tuple are posted in order
on both sides. Ranks that were given no order for a peer (the tied weights' own group) post
in call order, which their exchange keeps alike on both ends.

Varying shapes (``CommOptions.varying_shapes``): every message between stages (not the tied
weights') is sent as a header first, an int64 tensor of the sizes of each of its tensors,
then the tensors. A receive posted ahead posts the header only; the data's receive is posted
once the header is in (at the receive, or earlier where a later message of the same sender
is waited for). Ordered, the header and its data are two messages in the agreed order: once
a header is posted, nothing more from that sender is posted ahead until its data's receive
is, so both ends post in one order. Gradients carry a header too, one uniform rule rather
than the sender of the activation sizing them (a message of a few bytes per message).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from pipeoptim.errors import PeerLostError
from pipeoptim.runtime.comm.failure_board import backend_cause
from pipeoptim.runtime.comm.parent_watch import stop_if_orphaned
from pipeoptim.runtime.comm.transport import (
    MessageKey,
    Parts,
    RecvSpec,
    Transport,
    describe_message,
)
from pipeoptim.runtime.payload import MAX_PARTS, Message

__all__ = ["DistTransport"]

_KINDS = {"act": 0, "grad": 1, "eval": 2, "target": 3, "eval_target": 4, "tie": 5}
_TAG_LIMIT = 2**30
_PART_STRIDE = _TAG_LIMIT // MAX_PARTS  # part i of a tuple: its message's tag + i x stride


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
        one_tag: bool = False,
        tag_stages: int | None = None,
        varying_shapes: bool = False,
    ) -> None:
        self.rank = rank
        self.varying_shapes = varying_shapes
        """Each message between stages carries its sizes in a header sent first."""
        self.device = device
        self._group = group
        """The process group the messages go over (None: the default one); peers are still
        addressed by their rank in the default group."""
        self._num_stages = num_stages
        self._tag_stages = num_stages if tag_stages is None else tag_stages
        """Stages of the pipeline, which the tags count in: with several stages per rank
        they outnumber the ranks, and a count of ranks would give two messages one tag."""
        self._first = first_rank
        """Process-group rank of this pipeline's rank 0 (replica x P under data parallelism):
        peers are named by pipeline rank, addressed by process-group rank."""
        self._recvs: dict[MessageKey, tuple[dist.Work, Tensor, int]] = {}
        self._part_recvs: dict[MessageKey, list[tuple[dist.Work, Tensor]]] = {}
        self._sends: list[tuple[dist.Work, Tensor, int, MessageKey]] = []
        self.ordered = one_tag or (dist.is_initialized() and dist.get_backend(group) == "nccl")
        """Messages go under one tag and are matched in posting order (NCCL always; gloo
        with ``one_tag``, ``CommOptions.one_tag``)."""
        self._order: dict[int, deque[RecvSpec]] = {}
        """Per sending rank, the receives not yet posted, in the order it sends them."""
        self._headers: dict[MessageKey, tuple[dist.Work, Tensor, RecvSpec]] = {}
        """Varying shapes: the headers posted whose data's receive is not yet."""
        self._blocked: dict[int, MessageKey] = {}
        """Ordered, varying shapes: per sender, the message whose header is posted and whose
        data is not (nothing after it is posted before)."""

    @property
    def needs_order(self) -> bool:
        return self.ordered

    def expect(self, orders: Mapping[int, Sequence[RecvSpec]]) -> None:
        if not self.ordered:
            return
        for peer, left in self._order.items():
            if left:
                raise RuntimeError(
                    f"rank {self.rank}: {describe_message(left[0][0])} from rank "
                    f"{self._first + peer} was agreed but never received"
                )
        self._order = {peer: deque(self._over_wire(specs)) for peer, specs in orders.items()}

    def forget(self, keep: Callable[[MessageKey], bool]) -> None:
        if self.ordered:
            for peer, queue in self._order.items():
                self._order[peer] = deque(spec for spec in queue if keep(spec[0]))

    def _over_wire(self, specs: Sequence[RecvSpec]) -> list[RecvSpec]:
        """The receives of ``specs`` that this transport's process group carries."""
        return list(specs)

    def _posted(self, key: MessageKey) -> bool:
        return key in self._recvs or key in self._part_recvs or key in self._headers

    def _carries_shape(self, key: MessageKey) -> bool:
        return self.varying_shapes and key[0] != "tie"

    def _post_spec(self, spec: RecvSpec) -> None:
        if self._carries_shape(spec[0]):
            self._post_header(spec)
        elif len(spec) == 4:
            self._post_one(*spec)
        else:
            self._post_parts(*spec)

    def _post_through(self, key: MessageKey, peer: int, wait: bool = True) -> None:
        """Ordered: post every receive from ``peer`` up to ``key`` in the agreed order;
        ``wait``: also wait for the headers on the way (varying shapes), else stop at one."""
        queue = self._order.get(peer)
        if queue is None:  # no order given for this peer: post in call order
            return
        while not self._posted(key):
            blocked = self._blocked.get(peer)
            if blocked is not None:
                if not wait:  # posting ahead: the header's wait is the receive's
                    return
                self._open_header(blocked)
                continue
            if not queue:
                raise RuntimeError(
                    f"rank {self.rank}: {describe_message(key)} from rank "
                    f"{self._first + peer} is not in the order agreed from the schedule: the "
                    f"sender's messages (RankMessages.sent_by) and this rank's receives differ"
                )
            self._post_spec(queue.popleft())

    def _prepare(self, spec: RecvSpec, wait: bool) -> None:
        """Post ``spec``'s receive (ordered: with those before it); ``wait``: this rank is
        about to wait for it, so a header of varying shapes is waited for and the data's
        receive posted."""
        key, peer = spec[0], spec[1]
        if self.ordered and peer in self._order:
            self._post_through(key, peer, wait)
        else:
            self._post_spec(spec)
        if wait and key in self._headers:
            self._open_header(key)

    def _header(self, payload: Message) -> Tensor:
        parts = (payload,) if isinstance(payload, Tensor) else payload
        sizes = [d for t in parts for d in t.shape]
        return torch.tensor(sizes, dtype=torch.int64).to(self.device)

    def _post_header(self, spec: RecvSpec) -> None:
        key, peer = spec[0], spec[1]
        if self._posted(key):
            return
        ranks = [len(spec[2])] if len(spec) == 4 else [len(s) for s, _ in spec[2]]
        buf = torch.empty(sum(ranks), dtype=torch.int64, device=self.device)
        work = dist.irecv(buf, self._first + peer, tag=self._header_tag(key), group=self._group)
        if work is None:  # pragma: no cover
            raise RuntimeError(f"rank {self.rank}: irecv from rank {peer} returned no work")
        self._headers[key] = (work, buf, spec)
        if self.ordered:
            self._blocked[peer] = key

    def _open_header(self, key: MessageKey) -> None:
        """Wait for ``key``'s header and post its data's receive, sized by it."""
        work, buf, spec = self._headers.pop(key)
        peer = spec[1]
        self._wait(
            work, peer, f"the sizes of {describe_message(key)} from rank {self._first + peer}"
        )
        sizes = [int(d) for d in buf.tolist()]
        if len(spec) == 4:
            self._post_one(key, peer, tuple(sizes), spec[3])
        else:
            parts, at = [], 0
            for shape, dtype in spec[2]:
                parts.append((tuple(sizes[at : at + len(shape)]), dtype))
                at += len(shape)
            self._post_parts(key, peer, tuple(parts))
        if self._blocked.get(peer) == key:
            del self._blocked[peer]

    def _header_tag(self, key: MessageKey) -> int:
        return 0 if self.ordered else _TAG_LIMIT + self._tag(key)  # above every data tag

    def _wire_tag(self, key: MessageKey) -> int:
        return 0 if self.ordered else self._tag(key)

    def _wire_part_tags(self, key: MessageKey, n: int) -> list[int]:
        tags = self._part_tags(key, n)  # refuses a tuple of too many parts either way
        return [0] * n if self.ordered else tags

    def _tag(self, key: MessageKey) -> int:
        # Unique among the messages a pair of ranks has in flight; wraps on very long runs.
        kind, stage, mb = key
        return ((mb * self._tag_stages + stage) * len(_KINDS) + _KINDS[kind]) % _TAG_LIMIT

    def send(self, tensor: Message, peer: int, key: MessageKey) -> None:
        if self._carries_shape(key):
            header = self._header(tensor)
            work = dist.isend(
                header, self._first + peer, tag=self._header_tag(key), group=self._group
            )
            if work is None:  # pragma: no cover
                raise RuntimeError(f"rank {self.rank}: isend to rank {peer} returned no work")
            self._sends.append((work, header, peer, key))
        if not isinstance(tensor, Tensor):
            self._send_parts(tensor, peer, key)
            return
        buf = tensor.detach().contiguous()
        work = dist.isend(buf, self._first + peer, tag=self._wire_tag(key), group=self._group)
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
            raise RuntimeError(f"{describe_message(key)} has {n} tensors, over {MAX_PARTS}")
        tag = self._tag(key)
        return [(tag + i * _PART_STRIDE) % _TAG_LIMIT for i in range(n)]

    def _send_parts(self, tensors: tuple[Tensor, ...], peer: int, key: MessageKey) -> None:
        for t, tag in zip(tensors, self._wire_part_tags(key, len(tensors)), strict=True):
            buf = t.detach().contiguous()
            work = dist.isend(buf, self._first + peer, tag=tag, group=self._group)
            if work is None:  # pragma: no cover
                raise RuntimeError(f"rank {self.rank}: isend to rank {peer} returned no work")
            self._sends.append((work, buf, peer, key))
        if len(self._sends) > 64:
            self._wait_sends(self._sends[:32])
            del self._sends[:32]

    def post_recv_parts(self, key: MessageKey, peer: int, parts: Parts) -> None:
        self._prepare((key, peer, parts), wait=False)

    def _post_parts(self, key: MessageKey, peer: int, parts: Parts) -> None:
        if key in self._part_recvs:
            return
        posted = []
        for (shape, dtype), tag in zip(parts, self._wire_part_tags(key, len(parts)), strict=True):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, self._first + peer, tag=tag, group=self._group)
            if work is None:  # pragma: no cover
                raise RuntimeError(f"rank {self.rank}: irecv from rank {peer} returned no work")
            posted.append((work, buf))
        self._part_recvs[key] = posted

    def recv_parts(self, key: MessageKey, peer: int, parts: Parts) -> tuple[Tensor, ...]:
        self._prepare((key, peer, parts), wait=True)
        what = f"{describe_message(key)} from rank {self._first + peer}"
        out = []
        for i, (work, buf) in enumerate(self._part_recvs.pop(key)):
            self._wait(work, peer, f"tensor {i} of {what}")
            out.append(buf)
        return tuple(out)

    def post_recv(
        self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        self._prepare((key, peer, tuple(shape), dtype), wait=False)

    def _post_one(
        self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        if key in self._recvs:
            return
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        work = dist.irecv(buf, self._first + peer, tag=self._wire_tag(key), group=self._group)
        if work is None:  # pragma: no cover
            raise RuntimeError(f"rank {self.rank}: irecv from rank {peer} returned no work")
        self._recvs[key] = (work, buf, peer)

    def recv(self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        self._prepare((key, peer, tuple(shape), dtype), wait=True)
        work, buf, _ = self._recvs.pop(key)
        self._wait(work, peer, f"{describe_message(key)} from rank {self._first + peer}")
        return buf

    def flush(self) -> None:
        self._wait_sends(self._sends)
        self._sends = []

    def _wait_sends(self, sends: list[tuple[dist.Work, Tensor, int, MessageKey]]) -> None:
        for work, _, peer, key in sends:
            self._wait(
                work, peer, f"delivery of {describe_message(key)} to rank {self._first + peer}"
            )

    def _wait(self, work: dist.Work, peer: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as err:  # gloo/NCCL report a dead peer or a timeout this way
            cause = backend_cause(err)
        else:
            return
        self._peer_lost(peer, what, cause)

    def _peer_lost(self, peer: int, what: str, cause: str) -> NoReturn:
        """Raise :class:`PeerLostError` for ``peer`` (a pipeline rank), which this rank was
        waiting on for ``what``; or end this process first where its launcher is gone."""
        stop_if_orphaned()  # the peer went because the launcher did: say that, and end
        lost = self._first + peer  # the process-group rank, as the launcher names ranks
        raise PeerLostError(f"lost rank {lost} while waiting for {what}: {cause}", lost)
