"""The multi-process transport for CPU ranks on one host: messages through shared memory.

Over gloo, a message between two processes on one host crosses the loopback TCP stack: the
sender's ``isend`` copies it into the socket inline, gloo's own thread reads it on the other
side, and both pay the stack's work per message. Here each directed pair of ranks on one host
has a ring of shared memory that the sender writes the tensor into, and a Unix socket that
carries the record (tag, offset, size) to the receiver and the receiver's acknowledgement
back; the receiver copies the tensor out and acknowledges, which frees its bytes. The socket
is what orders the bytes (a record is sent after its tensor is written, an acknowledgement
after the tensor is read; system calls are barriers on every architecture) and what tells a
rank its peer is gone (the connection closes).

What does not fit goes over gloo as before (:class:`DistTransport`): CUDA tensors, peers on
other hosts, and messages over half a ring. Both sides decide alike, from the tensor's size,
which receiver and sender both know; with varying shapes (``CommOptions.varying_shapes``)
the receiver knows it only from the message, so those messages go over gloo, header first
(:class:`DistTransport`), and the ring carries the rest (the tied weights' messages).

No rank ever waits on shared memory without serving its own: while it waits for a record or
for room in a ring, it reads every record that has reached it (copying out any it has not
asked for yet, under their tags) and every acknowledgement, so two ranks that send to each
other with full rings both go on.

``PIPEOPTIM_SHARED_MEMORY`` in the environment (the same on every rank) sets each ring's size
in MiB (4 by default, so messages up to 2 MiB go through shared memory); ``0`` keeps every
message on gloo, as NCCL's ``NCCL_SHM_DISABLE`` does for its own.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import selectors
import socket
import struct
import tempfile
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.comm.dist import DistTransport
from pipeoptim.runtime.comm.transport import MessageKey, Parts, RecvSpec, describe_message
from pipeoptim.runtime.payload import Message

__all__ = ["DEFAULT_RING_BYTES", "SharedMemoryTransport", "shared_memory_ring_bytes"]

DEFAULT_RING_BYTES = 4 * 2**20
"""Each directed pair's ring, mapped by both of its ranks: small, since it counts against a
cap on a process's address space (only the bytes in flight at once are ever touched: a ring
that empties starts again at its beginning). Messages over half of it go over gloo."""

_RECORD = struct.Struct("<qqq")  # tag, offset in the ring, bytes
_ACK = struct.Struct("<q")  # records read
_ALIGN = 64
_ENV = "PIPEOPTIM_SHARED_MEMORY"
_SETUP_SECONDS = 60.0


def shared_memory_ring_bytes() -> int:
    """Each ring's bytes from ``PIPEOPTIM_SHARED_MEMORY`` (MiB; 0: no shared memory)."""
    value = os.environ.get(_ENV, "").strip()
    if not value:
        return DEFAULT_RING_BYTES
    try:
        mib = float(value)
    except ValueError:
        mib = -1.0
    if mib < 0:
        raise RuntimeConfigError(
            f"{_ENV}={value!r}: give each shared-memory ring's size in MiB "
            f"({DEFAULT_RING_BYTES // 2**20} by default), or 0 to send every message over gloo"
        )
    return int(mib * 2**20) // _ALIGN * _ALIGN


def _host_identity() -> str:
    """Names this machine's memory: the host name and, on Linux, this boot."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


@dataclass
class _Outbound:
    """This rank's ring towards one peer, and the socket its records go out on."""

    sock: socket.socket
    ring: Tensor
    """The shared bytes (uint8)."""
    in_flight: deque[tuple[int, int]] = field(default_factory=deque)
    """(offset, end) of every record not yet acknowledged, oldest first."""
    acks: bytearray = field(default_factory=bytearray)
    closed: bool = False
    """The peer closed its end (it finished, or died)."""


@dataclass
class _Inbound:
    """One peer's ring towards this rank, and the socket its records come in on."""

    sock: socket.socket
    ring: Tensor
    pending: dict[int, deque[Tensor]] = field(default_factory=dict)
    """Records read before they were asked for, by tag, in the order they came (copied out,
    as bytes; a tag comes again only after it wraps on a long run)."""
    partial: bytearray = field(default_factory=bytearray)
    closed: bool = False


class SharedMemoryTransport(DistTransport):
    """:class:`DistTransport` whose CPU messages to ranks on the same host go through shared
    memory. Every rank of the process group builds one at the same time (their setup is a
    collective); ``timeout``: seconds a wait for a peer may last before the peer counts as
    lost."""

    def __init__(
        self,
        rank: int,
        num_stages: int,
        device: torch.device,
        *,
        timeout: float,
        first_rank: int = 0,
        ring_bytes: int = DEFAULT_RING_BYTES,
        one_tag: bool = False,
        tag_stages: int | None = None,
        varying_shapes: bool = False,
    ) -> None:
        super().__init__(
            rank,
            num_stages,
            device,
            first_rank=first_rank,
            one_tag=one_tag,
            varying_shapes=varying_shapes,
            tag_stages=tag_stages,
        )
        self._timeout = timeout
        self._ring_bytes = ring_bytes
        self._out: dict[int, _Outbound] = {}
        self._in: dict[int, _Inbound] = {}
        self._selector = selectors.DefaultSelector()
        if device.type == "cpu":
            self._connect()

    # -- setup ------------------------------------------------------------------------------

    def _connect(self) -> None:
        """Meets every rank of the default group: rings and sockets for this pipeline's pairs
        of ranks on one host, where both sides opened both directions (any other pair stays
        on gloo)."""
        me, world = dist.get_rank(), dist.get_world_size()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"\0pipeoptim-{uuid.uuid4().hex}"  # Linux's abstract names: no file left
        address: str | None = name
        try:
            listener.bind(name)
            listener.listen(world)
        except OSError:
            address = None
        seen = _gathered((_host_identity(), address))
        mine = range(self._first, self._first + self._num_stages)  # this pipeline's ranks
        peers = [
            r
            for r in mine
            if r != me
            and address is not None
            and seen[r][1] is not None
            and seen[r][0] == seen[me][0]
        ]
        rings: dict[int, tuple[str, mmap.mmap]] = {}
        try:
            opened, accepted, agreed = self._meet(peers, seen, listener, rings)
        finally:  # every peer has mapped its ring by the last gather, or never will
            listener.close()
            for path, _ in rings.values():
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for peer in peers:
            their_out, their_in = agreed[peer]
            if peer in opened and me in their_in and peer in accepted and me in their_out:
                self._add_pair(peer, opened.pop(peer), rings[peer][1], *accepted.pop(peer))
        for sock in opened.values():
            sock.close()
        for conn, _ in accepted.values():
            conn.close()

    def _meet(
        self,
        peers: list[int],
        seen: list[Any],
        listener: socket.socket,
        rings: dict[int, tuple[str, mmap.mmap]],
    ) -> tuple[
        dict[int, socket.socket],
        dict[int, tuple[socket.socket, mmap.mmap]],
        list[tuple[list[int], list[int]]],
    ]:
        """Opens this rank's ring to each peer (into ``rings``, so the caller unlinks their
        files whatever happens here) and accepts the peers' rings: the sockets out, the
        sockets and rings in, and what every rank opened and accepted."""
        me = dist.get_rank()
        opened: dict[int, socket.socket] = {}
        for peer in peers:  # the outbound ring's file, and the socket its records go on
            with contextlib.suppress(OSError):
                path, ring = self._make_ring()
                rings[peer] = (path, ring)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(_SETUP_SECONDS)
                sock.connect(seen[peer][1])
                sock.sendall(_RECORD.pack(me, len(path.encode()), 0) + path.encode())
                opened[peer] = sock
        callers = sum(me in their for their in _gathered(sorted(opened)))
        accepted: dict[int, tuple[socket.socket, mmap.mmap]] = {}
        listener.settimeout(_SETUP_SECONDS)
        with contextlib.suppress(OSError):
            for _ in range(callers):
                conn, _ = listener.accept()
                conn.settimeout(_SETUP_SECONDS)
                sender, size, _ = _RECORD.unpack(_read_exactly(conn, _RECORD.size))
                path = _read_exactly(conn, size).decode()
                with open(path, "r+b") as f:
                    accepted[sender] = (conn, mmap.mmap(f.fileno(), self._ring_bytes))
        return opened, accepted, _gathered((sorted(opened), sorted(accepted)))

    def _make_ring(self) -> tuple[str, mmap.mmap]:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="pipeoptim-ring-", dir=folder)
        try:
            os.ftruncate(fd, self._ring_bytes)
            return path, mmap.mmap(fd, self._ring_bytes)
        except BaseException:
            os.unlink(path)  # no ring made: nobody else knows the file
            raise
        finally:
            os.close(fd)

    def _add_pair(
        self,
        global_peer: int,
        out_sock: socket.socket,
        out_ring: mmap.mmap,
        in_sock: socket.socket,
        in_ring: mmap.mmap,
    ) -> None:
        peer = global_peer - self._first  # pipeline rank; peers of other replicas never talk
        for sock in (out_sock, in_sock):
            sock.setblocking(False)
        self._out[peer] = _Outbound(out_sock, torch.frombuffer(out_ring, dtype=torch.uint8))
        self._in[peer] = _Inbound(in_sock, torch.frombuffer(in_ring, dtype=torch.uint8))
        self._selector.register(out_sock, selectors.EVENT_READ, (peer, False))
        self._selector.register(in_sock, selectors.EVENT_READ, (peer, True))

    def _shared(self, peer: int, nbytes: int, outbound: bool) -> bool:
        ends = self._out if outbound else self._in
        return peer in ends and nbytes <= self._ring_bytes // 2

    # -- sending ----------------------------------------------------------------------------

    def send(self, tensor: Message, peer: int, key: MessageKey) -> None:
        if self._carries_shape(key):
            super().send(tensor, peer, key)  # header first, over gloo
            return
        if isinstance(tensor, Tensor) and tensor.device.type == "cpu":
            if self._shared(peer, tensor.nbytes, outbound=True):
                self._write(tensor, peer, self._tag(key), key)
                return
        elif not isinstance(tensor, Tensor) and all(
            t.device.type == "cpu" and self._shared(peer, t.nbytes, outbound=True) for t in tensor
        ):
            for t, tag in zip(tensor, self._part_tags(key, len(tensor)), strict=True):
                self._write(t, peer, tag, key)
            return
        super().send(tensor, peer, key)

    def _write(self, tensor: Tensor, peer: int, tag: int, key: MessageKey) -> None:
        end, nbytes = self._out[peer], tensor.nbytes
        self._read_acks(peer, end)
        offset = self._room(end, nbytes)
        while offset is None:
            if end.closed:
                self._lost(peer, f"acknowledgements from rank {self._first + peer}", None)
            self._progress(f"room for {describe_message(key)} in the ring to rank {peer}", peer)
            offset = self._room(end, nbytes)
        if nbytes:
            view = end.ring[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
        end.in_flight.append((offset, offset + _span(nbytes)))
        self._send_all(end.sock, _RECORD.pack(tag, offset, nbytes), peer)

    def _room(self, end: _Outbound, nbytes: int) -> int | None:
        """Where a record of ``nbytes`` fits in the ring now (None: nowhere yet)."""
        if not end.in_flight:
            return 0
        size = _span(nbytes)
        (oldest, _), (newest, last) = end.in_flight[0], end.in_flight[-1]
        if newest >= oldest:  # in flight: [oldest, last); free: [last, ring) and [0, oldest)
            if last + size <= self._ring_bytes:
                return last
            return 0 if size <= oldest else None
        return last if last + size <= oldest else None  # wrapped: free is [last, oldest)

    def _send_all(self, sock: socket.socket, data: bytes, peer: int) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                self._progress(f"rank {self._first + peer} to take a record", peer, sock)
            except OSError as err:
                self._lost(peer, f"rank {self._first + peer} to take a record", err)

    def _received(self, end: _Outbound | _Inbound) -> bytes | None:
        """What has reached ``end``'s socket (None: nothing yet, or the peer closed it, which
        marks the end closed: a lost peer only where this rank still needs it, as
        :meth:`_write` and :meth:`_take` say)."""
        if end.closed:
            return None
        try:
            data = end.sock.recv(65536)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            end.closed = True
            self._selector.unregister(end.sock)
            return None
        return data

    def _read_acks(self, peer: int, end: _Outbound) -> None:
        data = self._received(end)
        if data is None:
            return
        end.acks += data
        whole = len(end.acks) // _ACK.size * _ACK.size
        for (count,) in _ACK.iter_unpack(bytes(end.acks[:whole])):
            for _ in range(count):
                end.in_flight.popleft()
        del end.acks[:whole]

    # -- receiving --------------------------------------------------------------------------

    def _over_wire(self, specs: Sequence[RecvSpec]) -> list[RecvSpec]:
        # the agreed order on gloo holds the messages that do not go through a ring (a
        # ring's records keep their own tags, each copied out under its own)
        return [spec for spec in specs if not self._through_ring(spec)]

    def _through_ring(self, spec: RecvSpec) -> bool:
        if self._carries_shape(spec[0]):
            return False
        if len(spec) == 4:
            _, peer, shape, dtype = spec
            parts: Parts = ((shape, dtype),)
        else:
            _, peer, parts = spec
        return all(self._shared(peer, _nbytes(s, d), outbound=False) for s, d in parts)

    def post_recv(
        self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        if not self._through_ring((key, peer, tuple(shape), dtype)):
            super().post_recv(key, peer, shape, dtype)

    def post_recv_parts(self, key: MessageKey, peer: int, parts: Parts) -> None:
        if not self._through_ring((key, peer, parts)):
            super().post_recv_parts(key, peer, parts)

    def recv(self, key: MessageKey, peer: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        if not self._through_ring((key, peer, tuple(shape), dtype)):
            return super().recv(key, peer, shape, dtype)
        what = f"{describe_message(key)} from rank {self._first + peer}"
        return self._take(peer, self._tag(key), tuple(shape), dtype, what)

    def recv_parts(self, key: MessageKey, peer: int, parts: Parts) -> tuple[Tensor, ...]:
        if not self._through_ring((key, peer, parts)):
            return super().recv_parts(key, peer, parts)
        what = f"{describe_message(key)} from rank {self._first + peer}"
        tags = self._part_tags(key, len(parts))
        return tuple(
            self._take(peer, tag, tuple(shape), dtype, f"tensor {i} of {what}")
            for i, ((shape, dtype), tag) in enumerate(zip(parts, tags, strict=True))
        )

    def _take(
        self, peer: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype, what: str
    ) -> Tensor:
        end = self._in[peer]
        while tag not in end.pending:
            if end.closed:
                self._lost(peer, what, None)
            if not self._read_records(peer, end):
                self._progress(what, peer)
        queue = end.pending[tag]
        data = queue.popleft()
        if not queue:
            del end.pending[tag]
        expected = _nbytes(shape, dtype)
        if data.numel() != expected:
            raise RuntimeError(
                f"{what} has {data.numel()} bytes where this rank expects {expected} "
                f"(shape {list(shape)}, {dtype}): the two ranks disagree on the message's "
                f"shape; a boundary whose shape changes from batch to batch needs the same "
                f"shape promise on both ranks"
            )
        return data.view(dtype).view(shape) if expected else torch.empty(shape, dtype=dtype)

    def _read_records(self, peer: int, end: _Inbound) -> bool:
        """Copies out every record that has reached this rank from ``peer`` and acknowledges
        them; whether any came, or the peer closed its end."""
        data = self._received(end)
        if data is None:
            return end.closed
        end.partial += data
        whole = len(end.partial) // _RECORD.size * _RECORD.size
        count = 0
        for tag, offset, nbytes in _RECORD.iter_unpack(bytes(end.partial[:whole])):
            end.pending.setdefault(tag, deque()).append(end.ring[offset : offset + nbytes].clone())
            count += 1
        del end.partial[:whole]
        if count:
            self._send_all(end.sock, _ACK.pack(count), peer)
        return True

    def _progress(self, what: str, peer: int, writing: socket.socket | None = None) -> None:
        """Waits until some socket of this rank's has something (or ``writing`` has room),
        then serves them all: records in (copied out and acknowledged), acknowledgements
        back."""
        if writing is not None:
            data = self._selector.get_key(writing).data
            self._selector.modify(writing, selectors.EVENT_READ | selectors.EVENT_WRITE, data)
        try:
            ready = self._selector.select(timeout=self._timeout)
        finally:
            if writing is not None:
                self._selector.modify(writing, selectors.EVENT_READ, data)
        if not ready:
            self._peer_lost(peer, what, f"nothing came in {self._timeout:g} s (the run's timeout)")
        for key, events in ready:
            if not events & selectors.EVENT_READ:
                continue
            other, inbound = key.data
            if inbound:
                self._read_records(other, self._in[other])
            else:
                self._read_acks(other, self._out[other])

    def _lost(self, peer: int, what: str, err: OSError | None) -> NoReturn:
        cause = "its connection closed" if err is None else f"{type(err).__name__}: {err}"
        self._peer_lost(peer, what, cause)

    def close(self) -> None:
        """Closes the sockets (the rings go with the last mapping)."""
        self._selector.close()
        for sock in [e.sock for e in self._out.values()] + [e.sock for e in self._in.values()]:
            sock.close()
        self._out.clear()
        self._in.clear()


def _span(nbytes: int) -> int:
    """The bytes a record of ``nbytes`` holds in a ring: at least one aligned block, so
    every record starts aligned and no two share a start."""
    return -(-max(nbytes, 1) // _ALIGN) * _ALIGN


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _gathered(value: Any) -> list[Any]:
    """Every rank's ``value`` of the default group, by rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    if len(data) != n:
        raise OSError(f"setup message cut short ({len(data)} of {n} bytes)")
    return data
