"""DistTransport over two real gloo processes: bounded send buffers and tags that wrap."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeoptim.runtime.comm import dist as dist_transport
from pipeoptim.runtime.comm import local
from pipeoptim.runtime.comm.dist import DistTransport

MESSAGES = 300


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, out: Any) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    dist_transport._TAG_LIMIT = 7  # every tag is reused dozens of times within the run
    link = DistTransport(rank, 2, torch.device("cpu"))
    try:
        if rank == 0:
            most = 0
            for mb in range(MESSAGES):
                link.send(torch.full((4,), float(mb)), 1, ("act", 0, mb))
                most = max(most, len(link._sends))
            link.flush()
            out.put(("sent", most))
        else:
            got = [
                float(link.recv(("act", 0, mb), 0, (4,), torch.float32)[0])
                for mb in range(MESSAGES)
            ]
            out.put(("received", got))
    finally:
        dist.destroy_process_group()


def test_many_sends_stay_bounded_and_wrapped_tags_keep_the_order() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results["sent"] <= 65  # the oldest 32 are waited on past 64 in flight
    assert results["received"] == [float(mb) for mb in range(MESSAGES)]


def test_only_a_transport_that_posts_receives_is_sent_them_ahead() -> None:
    """The executor announces receives ahead (a scan of the next actions after every
    action) only to a transport whose post hooks do something: gloo's, not the mailbox's."""
    assert not local.LocalTransport(0, {}).posts_receives
    assert DistTransport.__new__(DistTransport).posts_receives  # no process group needed

    class Posting(local.LocalTransport):
        def post_recv_parts(self, key: Any, peer: int, parts: Any) -> None:
            pass

    assert Posting(0, {}).posts_receives
