"""The single-process transport: every rank in this process, a shared mailbox."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pipeoptim.runtime.comm.transport import MessageKey, Parts, Transport
from pipeoptim.runtime.payload import Message

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    """All ranks in one process: a shared mailbox. Messages are copies, as over a wire, so a
    receiving stage can never write into a tensor the sending stage saved for backward."""

    def __init__(self, rank: int, mailbox: dict[MessageKey, Message]) -> None:
        self.rank = rank
        self._mailbox = mailbox

    @classmethod
    def group(cls, world_size: int) -> list[LocalTransport]:
        """One endpoint per rank, sharing a mailbox."""
        mailbox: dict[MessageKey, Message] = {}
        return [cls(r, mailbox) for r in range(world_size)]

    def send(self, tensor: Message, peer: int, key: MessageKey) -> None:
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

    def _take(self, key: MessageKey, peer: int) -> Message:
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
