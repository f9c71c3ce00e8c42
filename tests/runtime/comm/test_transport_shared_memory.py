"""SharedMemoryTransport over two real gloo processes: every message arrives whole and in
its tag's order, whichever path it takes; full rings in both directions do not deadlock; a
peer that dies is named at once; ``PIPEOPTIM_SHARED_MEMORY=0`` keeps everything on gloo."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeoptim.errors import PeerLostError, RuntimeConfigError
from pipeoptim.runtime.comm import dist as dist_transport
from pipeoptim.runtime.comm.dist import DistTransport
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.runtime.comm.shared_memory import (
    DEFAULT_RING_BYTES,
    SharedMemoryTransport,
    _Outbound,
    shared_memory_ring_bytes,
)

RING = 64 * 1024
"""A small ring, so the tests fill it: messages over 32 KiB go over gloo."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(body: Callable[[int, Any], None], env: dict[str, str] | None = None) -> dict[Any, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, body, env or {}, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return results


def _rank(
    rank: int, port: int, body: Callable[[int, Any], None], env: dict[str, str], out: Any
) -> None:
    os.environ.update(env)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        body(rank, out)
    finally:
        dist.destroy_process_group()


def _messages() -> list[tuple[Any, tuple[str, int, int]]]:
    """Tensors of every kind a stage sends, small and over half the ring, and tuples."""
    g = torch.Generator().manual_seed(0)
    msgs: list[tuple[Any, tuple[str, int, int]]] = []
    for mb in range(40):
        msgs.append((torch.randn(3, 5, generator=g), ("act", 1, mb)))
        msgs.append((torch.randint(0, 9, (7,), generator=g), ("target", 1, mb)))
        msgs.append((torch.randn(4, 8, generator=g).to(torch.bfloat16), ("eval", 1, mb)))
        mask = torch.rand(2, 3, generator=g) > 0.5
        msgs.append(((torch.randn(2, 3, generator=g), mask), ("tie", 1, mb)))
    msgs.append((torch.randn(64, 256, generator=g), ("act", 1, 99)))  # 64 KiB: over gloo
    msgs.append((torch.empty(0, 4), ("act", 1, 100)))
    return msgs


def _round_trip(rank: int, out: Any) -> None:
    link = ProcessModel.PROCESS_PER_STAGE.transports(2, rank, torch.device("cpu"), 0, 60)[rank]
    assert isinstance(link, SharedMemoryTransport)
    link._ring_bytes = RING  # the rings are made already; only the size rule reads it now
    msgs = _messages()
    if rank == 0:
        for tensor, key in msgs:
            link.send(tensor, 1, key)
        link.flush()
        out.put((rank, len(link._out)))
        return
    got: dict[tuple[str, int, int], Any] = {}
    for tensor, key in reversed(msgs):  # the last first: every earlier one waits as pending
        if isinstance(tensor, tuple):
            parts = tuple((tuple(t.shape), t.dtype) for t in tensor)
            got[key] = link.recv_parts(key, 0, parts)
        else:
            got[key] = link.recv(key, 0, tuple(tensor.shape), tensor.dtype)
    exact = all(
        all(torch.equal(a, b) for a, b in zip(t, got[k], strict=True))
        if isinstance(t, tuple)
        else torch.equal(t, got[k]) and got[k].dtype == t.dtype
        for t, k in msgs
    )
    trained = got[("act", 1, 0)].requires_grad_()
    (trained * 2).sum().backward()
    out.put((rank, (len(link._in), exact, trained.grad is not None)))


def test_every_message_arrives_whole_out_of_order_and_over_either_path() -> None:
    results = _run(_round_trip)
    assert results[0] == 1  # rank 0 writes to rank 1 through shared memory
    assert results[1] == (1, True, True)


TAG_MESSAGES = 200


def _wrapped_tags(rank: int, out: Any) -> None:
    dist_transport._TAG_LIMIT = 7  # every tag comes back dozens of times
    link = SharedMemoryTransport(rank, 2, torch.device("cpu"), timeout=60, ring_bytes=RING)
    if rank == 0:
        for mb in range(TAG_MESSAGES):
            link.send(torch.full((4,), float(mb)), 1, ("act", 0, mb))
        out.put((rank, None))
        return
    got = [
        float(link.recv(("act", 0, mb), 0, (4,), torch.float32)[0]) for mb in range(TAG_MESSAGES)
    ]
    out.put((rank, got))


def test_a_tag_that_comes_again_keeps_its_messages_in_order() -> None:
    assert _run(_wrapped_tags)[1] == [float(mb) for mb in range(TAG_MESSAGES)]


EACH_WAY = 60


def _both_ways_full(rank: int, out: Any) -> None:
    """Each rank sends more than the ring holds before it receives anything."""
    link = SharedMemoryTransport(rank, 2, torch.device("cpu"), timeout=60, ring_bytes=RING)
    peer = 1 - rank
    for mb in range(EACH_WAY):  # 16 KiB each: the ring holds 4
        link.send(torch.full((4096,), float(rank * 1000 + mb)), peer, ("act", peer, mb))
    got = [
        float(link.recv(("act", rank, mb), peer, (4096,), torch.float32)[0])
        for mb in range(EACH_WAY)
    ]
    out.put((rank, got))


def test_two_ranks_that_fill_each_others_rings_both_go_on() -> None:
    results = _run(_both_ways_full)
    assert results[0] == [float(1000 + mb) for mb in range(EACH_WAY)]
    assert results[1] == [float(mb) for mb in range(EACH_WAY)]


def _peer_dies(rank: int, out: Any) -> None:
    link = SharedMemoryTransport(rank, 2, torch.device("cpu"), timeout=60, ring_bytes=RING)
    if rank == 1:
        out.put((rank, None))
        out.close()
        out.join_thread()  # the line above has left before the process goes
        os._exit(0)  # gone without a word
    try:
        link.recv(("grad", 0, 0), 1, (4,), torch.float32)
    except PeerLostError as err:
        out.put((rank, (err.peer, str(err))))


def test_a_peer_that_dies_is_named_at_once() -> None:
    peer, message = _run(_peer_dies)[0]
    assert peer == 1
    assert "lost rank 1 while waiting for the gradient of micro-batch 0 for stage 0" in message
    assert "connection closed" in message


def _setup_fails(rank: int, out: Any) -> None:
    """Both ranks fail at the setup's second gather, after each has made its ring file."""
    from pipeoptim.runtime.comm import shared_memory

    made: list[str] = []
    make, gather = SharedMemoryTransport._make_ring, shared_memory._gathered
    calls = []

    def recording(self: SharedMemoryTransport) -> tuple[str, Any]:
        path, ring = make(self)
        made.append(path)
        return path, ring

    def failing(value: Any) -> list[Any]:
        calls.append(value)
        if len(calls) == 2:
            raise RuntimeError("a collective failed")
        return gather(value)

    SharedMemoryTransport._make_ring = recording  # type: ignore[method-assign]
    shared_memory._gathered = failing
    try:
        SharedMemoryTransport(rank, 2, torch.device("cpu"), timeout=60, ring_bytes=RING)
    except RuntimeError as err:
        out.put((rank, (str(err), made, [os.path.exists(p) for p in made])))


def test_a_setup_that_fails_leaves_no_ring_file() -> None:
    for rank, (error, made, left) in _run(_setup_fails).items():
        assert error == "a collective failed", rank
        assert len(made) == 1 and left == [False], (rank, made, left)


def _picked(rank: int, out: Any) -> None:
    link = ProcessModel.PROCESS_PER_STAGE.transports(2, rank, torch.device("cpu"), 0, 60)[rank]
    out.put((rank, type(link).__name__))


@pytest.mark.parametrize(
    ("env", "picked"),
    [({}, "SharedMemoryTransport"), ({"PIPEOPTIM_SHARED_MEMORY": "0"}, "DistTransport")],
)
def test_the_environment_switch_keeps_messages_on_gloo(env: dict[str, str], picked: str) -> None:
    assert _run(_picked, env) == {0: picked, 1: picked}
    assert issubclass(SharedMemoryTransport, DistTransport)


def test_the_ring_size_comes_from_the_environment_in_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPEOPTIM_SHARED_MEMORY", raising=False)
    assert shared_memory_ring_bytes() == DEFAULT_RING_BYTES
    monkeypatch.setenv("PIPEOPTIM_SHARED_MEMORY", "32")
    assert shared_memory_ring_bytes() == 32 * 2**20
    monkeypatch.setenv("PIPEOPTIM_SHARED_MEMORY", "0")
    assert shared_memory_ring_bytes() == 0
    for bad in ("off", "-1"):
        monkeypatch.setenv("PIPEOPTIM_SHARED_MEMORY", bad)
        with pytest.raises(RuntimeConfigError, match=r"size in MiB \(4 by default\), or 0"):
            shared_memory_ring_bytes()


def test_a_record_goes_where_the_ring_is_free_and_never_over_one_in_flight() -> None:
    """The ring's placement, record by record: 4 blocks of 64 bytes; a full ring that has
    wrapped has no room even where its newest record ends at its oldest's start."""
    link = SharedMemoryTransport.__new__(SharedMemoryTransport)
    link._ring_bytes = 256
    end = _Outbound(cast(socket.socket, None), torch.empty(256, dtype=torch.uint8))
    placed = []
    for _ in range(4):
        offset = link._room(end, 60)  # rounded up to a 64-byte block
        assert offset is not None
        end.in_flight.append((offset, offset + 64))
        placed.append(offset)
    assert placed == [0, 64, 128, 192]
    assert link._room(end, 1) is None  # full
    end.in_flight.popleft()  # the record at 0 read
    assert link._room(end, 65) is None  # two blocks fit nowhere
    assert link._room(end, 64) == 0  # wraps to the start
    end.in_flight.append((0, 64))
    assert link._room(end, 1) is None  # wrapped and full: [0, 64) ends where 64 starts
    end.in_flight.popleft()  # the record at 64 read
    assert link._room(end, 0) == 64  # an empty message still takes a block of its own
    end.in_flight.clear()
    assert link._room(end, 256) == 0  # an empty ring starts again at its beginning
