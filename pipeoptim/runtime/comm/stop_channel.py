"""How a callback's stop reaches every process under ``dist``.

The process that reads the losses (the last stage's, replica 0's: the *decider*) runs the
callbacks that may stop. At each log point inside a segment it sends every other process
one small message: stop there or go on. A process waits for it only before it would begin
work on a mini-batch past that point's horizon (``segments.stop_horizons``), which the
schedule itself keeps it from beginning until after the loss was read, so the wait is
for a message already sent. At a segment's end the decision is one broadcast.

The messages go over a gloo group of their own, as CPU tensors: no device synchronisation,
and NCCL's matching of a pair's messages in posting order is left undisturbed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeoptim.runtime.comm.replicas import collective

__all__ = ["StopChannel"]

_TAG_LIMIT = 2**30


class StopChannel:
    """The stop decisions of one fit, from the decider to every other process."""

    def __init__(self, group: dist.ProcessGroup, decider: int) -> None:
        self.group = group
        self.decider = decider
        """The world rank whose stop counts."""
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}

    @property
    def decides(self) -> bool:
        return self.rank == self.decider

    def any(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on any process (a collective)."""
        box = torch.tensor([int(flag)])
        with collective(self.group, what):
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
        return bool(box.item())

    # -- inside a segment ------------------------------------------------------------------
    def send(self, step: int, stop: bool) -> None:
        """The decider: the decision at the log point of mini-batch ``step``."""
        buf = torch.tensor([int(stop), step], dtype=torch.int64)
        for peer in range(self.world):
            if peer != self.rank:
                work = dist.isend(buf, peer, group=self.group, tag=step % _TAG_LIMIT)
                if work is not None:
                    self._sends.append((work, buf))

    def post(self, step: int) -> None:
        """Receive the decision at ``step`` in the background (another process)."""
        if step in self._posted:
            return
        buf = torch.zeros(2, dtype=torch.int64)
        work = dist.irecv(buf, self.decider, group=self.group, tag=step % _TAG_LIMIT)
        if work is None:  # pragma: no cover - only when this rank is not in the group
            raise RuntimeError(f"rank {self.rank}: irecv of a stop decision returned no work")
        self._posted[step] = (work, buf)

    def wait(self, step: int) -> bool:
        """The decision at ``step`` (waits for it)."""
        self.post(step)
        work, buf = self._posted.pop(step)
        with collective(self.group, f"waiting for the stop decision at mini-batch {step}"):
            work.wait()
        if int(buf[1]) != step:
            raise RuntimeError(
                f"rank {self.rank}: the stop decision of mini-batch {int(buf[1])} came where "
                f"that of {step} was expected"
            )
        return bool(buf[0])

    def flush(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    # -- at a segment's end ------------------------------------------------------------------
    def agree(self, stop: bool) -> bool:
        """The decider's ``stop``, on every process."""
        box = torch.tensor([int(stop)])
        with collective(self.group, "sharing a callback's stop"):
            dist.broadcast(box, src=self.decider, group=self.group)
        return bool(box.item())
