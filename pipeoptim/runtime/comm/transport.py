"""How activations and gradients move between stages: the interface every transport keeps.

The executor interprets the same lowered action list (``plan.passes.add_communication``)
whatever carries the tensors, so the single-process path and the multi-process path cannot
drift apart. A transport is one class here or beside this file:

* :class:`~pipeoptim.runtime.comm.local.LocalTransport`: every rank lives in one process on
  one device and a message is a dictionary entry. Deterministic, no threads; the fast path
  on CPU and on a single GPU.
* :class:`~pipeoptim.runtime.comm.dist.DistTransport`: one rank per process over
  ``torch.distributed`` point-to-point operations (gloo on CPU, NCCL on CUDA).
* :class:`~pipeoptim.runtime.comm.shared_memory.SharedMemoryTransport`: the same, with the
  CPU messages between ranks on one host written through shared memory (the default under
  gloo).

Which processes the ranks live in is the process model
(:mod:`~pipeoptim.runtime.comm.process_model`), not the transport: a new transport is a new
class, a new process model a new value there.

A message is named by ``(kind, receiving stage, micro-batch)``. A message may be a tuple of
tensors (a stage that hands on hidden states and a mask), ``payload.MAX_PARTS`` parts at most.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import torch
from torch import Tensor

from pipeoptim.runtime.payload import Message

__all__ = ["MessageKey", "Parts", "RecvSpec", "Transport", "describe_message"]

MessageKey = tuple[str, int, int]
"""``(kind, receiving stage, micro-batch)``: kind ``act``, ``grad``, ``target`` (stage 0's rank
to the last stage's: the targets and the mini-batch's counted targets, a tuple message),
``eval`` / ``eval_target`` for evaluation batches, or ``tie`` (a weight shared across stages:
``model/ties.py``)."""

Parts = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""The (shape, dtype) of each tensor of a tuple message, in order."""

RecvSpec: TypeAlias = (
    tuple[MessageKey, int, tuple[int, ...], torch.dtype] | tuple[MessageKey, int, Parts]
)
"""A receive: (key, peer, shape, dtype) of one tensor, or (key, peer, parts) of a tuple."""


class Transport(ABC):
    """Point-to-point messages between the ranks of one pipeline."""

    rank: int

    @abstractmethod
    def send(self, tensor: Message, peer: int, key: MessageKey) -> None:
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

    @property
    def needs_order(self) -> bool:
        """Whether messages are matched in posting order per pair of ranks and direction
        (NCCL, or gloo with one tag): the receiver must then post its receives in the order
        the sender posts its sends, which :meth:`expect` gives."""
        return False

    def expect(self, orders: Mapping[int, Sequence[RecvSpec]]) -> None:  # noqa: B027
        """Per sending rank, the receives this rank will post, in the order that rank posts
        the sends (``rank_messages.RankMessages.agreed_order``); replaces what was left.
        A no-op where messages are matched by name."""

    def forget(self, keep: Callable[[MessageKey], bool]) -> None:  # noqa: B027
        """Drop from the agreed order the receives not yet posted whose key fails ``keep``
        (a stop cut the segment short: their sends will never come)."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Wait until every message sent so far has left."""


def describe_message(key: MessageKey) -> str:
    """A message named in words: "the gradient of micro-batch 3 for stage 1"."""
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
