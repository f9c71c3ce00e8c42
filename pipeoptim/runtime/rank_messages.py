"""A rank's messages: what it sends and receives, under which names and in which shapes.

The executor (``executor.py``) runs a rank's actions; both ends of every message must agree
on its name (stage, micro-batch, evaluation or training) and on the shape the receiver
allocates before it arrives, and that agreement is this module's concern: the message
actions, the names, the receive specs, the receives posted ahead and where the last stage
takes its targets from. :class:`RankMessages` is the executor's base class, so a call costs
what it did inside one class.

The agreed order (NCCL's matching rule): where a transport matches a pair's messages in
posting order (``Transport.needs_order``: NCCL, or gloo with one tag), every rank computes,
from the segment's lowered action lists that every rank holds, the messages each other rank
sends it, in the order that rank posts them (:meth:`RankMessages.agreed_order`, built on
:meth:`RankMessages.sent_by`, the one list of what an action sends), and its transport posts
its receives in exactly that order. Nothing in it depends on timing: the lists are plain
data, so both ends of each direction of each pair derive the same sequence, whatever the
method (two stages per rank, asynchronous, evaluation passes, segments).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.actions import Action, Kind
from pipeoptim.runtime.boundary import Boundary, MappingSpec, TensorSpec
from pipeoptim.runtime.comm.transport import MessageKey, Parts, RecvSpec, Transport
from pipeoptim.runtime.payload import Gradients, Payload, parts, payload_bytes, rebuilt
from pipeoptim.runtime.segments import step_of

if TYPE_CHECKING:
    from pipeoptim.runtime.feed import TrainFeed
    from pipeoptim.runtime.stage.stage import Stage

__all__ = ["LOOKAHEAD", "RankMessages", "RecvSpec"]

LOOKAHEAD = 8
"""How many upcoming actions a rank scans to post its receives early."""


def _parts(b: tuple[TensorSpec, ...] | MappingSpec, n: int, grad: bool) -> Parts:
    """A tuple or dict boundary's tensors for ``n`` samples (a dict's in its key order, its
    None values left out); ``grad``: the floating-point ones."""
    specs = b.parts if isinstance(b, MappingSpec) else b
    return tuple(((n, *p.shape), p.dtype) for p in specs if not grad or p.dtype.is_floating_point)


class RankMessages:
    """The message side of :class:`~pipeoptim.runtime.executor.RankExecutor`, its base class.

    It holds no state of its own: ``RankExecutor.__init__`` sets what is declared here."""

    rank: int
    stages: dict[int, Stage]
    transport: Transport
    _posts_receives: bool
    boundaries: list[Boundary]
    target: TensorSpec
    micro_size: int
    rank_of: dict[int, int]
    last: int
    target_feed: TrainFeed | None
    targets_read: bool
    wait_s: float
    _actions: list[Action]
    _pos: int
    _first: int
    _m: int
    _inputs: dict[tuple[int, int], Payload]
    _grads: dict[tuple[int, int], Gradients]
    _targets: dict[int, tuple[Tensor, Tensor | int | None]]
    _eval_sizes: list[int]
    _eval_first: int
    _gates: list[tuple[int, int]]
    post_limits: list[tuple[int, int]]

    @property
    def evaluating(self) -> bool:
        return bool(self._eval_sizes)

    def _needs_target_message(self, a: Action) -> bool:
        if self.targets_read and not self.evaluating:
            return False
        return a.kind is Kind.FORWARD and a.stage == self.last and 0 not in self.stages

    def _take_target(self, mb: int) -> tuple[Tensor, Tensor | int | None]:
        """Micro-batch ``mb``'s targets and, in training, the counted targets of its whole
        mini-batch (``loss.token_share``), whichever way they reach the last stage."""
        if mb in self._targets:
            return self._targets.pop(mb)
        if self.target_feed is not None and not self.evaluating:
            step, j = divmod(mb, self._m)
            y = self.target_feed.micro_batch(self._first + step, j)[1]
            return y, self.target_feed.counted_here(self._first + step)
        spec = self._target_spec(mb)
        if len(spec) == 4:
            return self.transport.recv(*spec), None
        y, counted = self.transport.recv_parts(*spec)
        # on the CPU reading it costs nothing, and the weighting is decided on the host
        return y, int(counted) if counted.device.type == "cpu" else counted

    def _target_spec(self, mb: int) -> RecvSpec:
        """The target message of micro-batch ``mb``: in training the targets and the
        mini-batch's counted targets (one int64), a tuple message; in evaluation the
        targets alone."""
        n = self._size(mb)
        shape = (n, *self.target.shape)
        if self.evaluating:
            key: MessageKey = ("eval_target", self.last, self._eval_first + mb)
            return key, self.rank_of[0], shape, self.target.dtype
        parts: Parts = ((shape, self.target.dtype), ((1,), torch.int64))
        return ("target", self.last, self._global(mb)), self.rank_of[0], parts

    def _size(self, mb: int) -> int:
        return self._eval_sizes[mb] if self.evaluating else self.micro_size

    def _communicate(self, a: Action) -> tuple[int, int, int]:
        k, mb = a.stage, a.mb
        act, grad = ("eval", "eval") if self.evaluating else ("act", "grad")
        t: Payload
        if a.kind is Kind.SEND_F:
            t = self._inputs.pop((k + 1, mb))
            # a dict travels as its tensors, in the dry run's key order
            sent = parts(t) if isinstance(t, dict) else t
            self.transport.send(sent, self.rank_of[k + 1], (act, k + 1, self._message_mb(mb)))
        elif a.kind is Kind.SEND_B:
            g = self._grads.pop((k - 1, mb))
            # a tuple's gradient travels for its floating-point tensors only
            t = g if isinstance(g, Tensor) else tuple(p for p in g if p is not None)
            self.transport.send(t, self.rank_of[k - 1], (grad, k - 1, self._message_mb(mb)))
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            spec = self._recv_spec(a)
            waited = time.perf_counter()
            t = self.transport.recv(*spec) if len(spec) == 4 else self.transport.recv_parts(*spec)
            self.wait_s += time.perf_counter() - waited
            if a.kind is Kind.RECV_F:
                b = self.boundaries[k - 1]
                got: Payload = t
                if isinstance(b, MappingSpec):  # rebuilt from the dry run's keys
                    assert isinstance(t, tuple)
                    got = rebuilt(b.keys, [v is not None for v in b.values], t)
                self._inputs[(k, mb)] = got
            else:
                self._grads[(k, mb)] = t
        else:
            raise RuntimeError(f"rank {self.rank}: action {a} is for a stage it does not hold")
        return 0, t.numel() * t.element_size() if isinstance(t, Tensor) else payload_bytes(t), 0

    def _recv_key(self, a: Action) -> MessageKey:
        """The name of the message a receive action takes (the first item of its spec)."""
        mb = self._message_mb(a.mb)
        if a.kind is Kind.RECV_F:
            return ("eval" if self.evaluating else "act", a.stage, mb)
        return ("grad", a.stage, mb)

    def _recv_spec(self, a: Action) -> RecvSpec:
        n, k, key = self._size(a.mb), a.stage, self._recv_key(a)
        if a.kind is Kind.RECV_F:
            b = self.boundaries[k - 1]
            if not isinstance(b, TensorSpec):
                return key, self.rank_of[k - 1], _parts(b, n, grad=False)
            return key, self.rank_of[k - 1], (n, *b.shape), b.dtype
        b = self.boundaries[k]
        if not isinstance(b, TensorSpec):
            return key, self.rank_of[k + 1], _parts(b, n, grad=True)
        return key, self.rank_of[k + 1], (n, *b.shape), b.grad_dtype

    def _global(self, mb: int) -> int:
        """A segment's micro-batch id as the run counts it (messages and the trace)."""
        return self._first * self._m + mb

    def _message_mb(self, mb: int) -> int:
        return self._eval_first + mb if self.evaluating else self._global(mb)

    # -- the agreed order of each channel (transports that match in posting order) ---------

    def sent_by(self, a: Action, holder: int) -> list[tuple[int, RecvSpec]]:
        """What rank ``holder``'s action ``a`` sends, in posting order: (receiving rank, the
        receive that takes it, ``holder`` as its peer). Every message of the pipeline's
        transport is listed here and nowhere else, so a new kind of message (sent where the
        executor runs the action) is one more entry here."""
        k, mb = a.stage, a.mb
        if a.kind is Kind.FORWARD and k == 0 and self.rank_of[self.last] != holder:
            if self.evaluating or not self.targets_read:  # the targets ride with stage 0's input
                return [(self.rank_of[self.last], self._target_spec(mb))]  # from rank_of[0]
        elif a.kind is Kind.SEND_F:
            return [(self.rank_of[k + 1], self._recv_spec(Action(k + 1, Kind.RECV_F, mb)))]
        elif a.kind is Kind.SEND_B:
            return [(self.rank_of[k - 1], self._recv_spec(Action(k - 1, Kind.RECV_B, mb)))]
        return []

    def agreed_order(self, lists: Mapping[int, Sequence[Action]]) -> dict[int, list[RecvSpec]]:
        """Per other rank, the receives of what it sends this rank, in its posting order
        (``lists``: every rank's lowered actions). Checked against this rank's own receives,
        so a message one end lists and the other does not is named before anything runs."""
        orders: dict[int, list[RecvSpec]] = {}
        for sender, actions in lists.items():
            if sender == self.rank:
                continue
            mine = [s for a in actions for to, s in self.sent_by(a, sender) if to == self.rank]
            if mine:
                orders[sender] = mine
        agreed = sorted(spec[0] for order in orders.values() for spec in order)
        taken = sorted(self._taken_keys(lists.get(self.rank, ())))
        if agreed != taken:
            odd = sorted(set(agreed) ^ set(taken))
            raise RuntimeError(
                f"rank {self.rank}: the messages the other ranks' actions send it and the "
                f"receives of its own actions differ ({len(agreed)} against {len(taken)}, "
                f"e.g. {odd[:3]}); RankMessages.sent_by must list every message the executor "
                f"sends"
            )
        return orders

    def _taken_keys(self, actions: Sequence[Action]) -> list[MessageKey]:
        """The names of the messages ``actions`` (this rank's) receive."""
        keys = []
        for a in actions:
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                keys.append(self._recv_key(a))
            elif self._needs_target_message(a):
                keys.append(self._target_spec(a.mb)[0])
        return keys

    def _agree(self, lists: Mapping[int, Sequence[Action]], stops: bool) -> None:
        """Hand the transport the agreed order of this segment (or evaluation chunk), where
        it matches in posting order. ``stops``: a callback may cut the segment at a log
        point, and no receive may be posted past one before its decision (``segments.
        stop_horizons``): each channel's steps must then never go back, so posting a receive
        never posts one of a later step before it."""
        if not self.transport.needs_order:
            return
        orders = self.agreed_order(lists)
        if stops:
            for sender, order in orders.items():
                steps = [spec[0][2] // self._m for spec in order]
                back = next((i for i in range(1, len(steps)) if steps[i] < steps[i - 1]), None)
                if back is not None:
                    raise RuntimeConfigError(
                        f"rank {sender} sends rank {self.rank} a message of step "
                        f"{steps[back - 1]} before one of step {steps[back]}: over NCCL (or "
                        f"with one tag) a segment a callback may stop cannot post its "
                        f"receives in that order; run without a stopping callback, or with "
                        f"log_every at a multiple of the segment length"
                    )
        self.transport.expect(orders)

    def _agree_after_cut(
        self,
        before: Mapping[int, Sequence[Action]],
        shorter: Mapping[int, Sequence[Action]] | None,
        last_step: int,
    ) -> None:
        """A stop cut the segment after ``last_step`` (global): the sends of later steps will
        never come. Each sender goes on with its list cut short or with the shorter
        segment's own (``RankExecutor.truncate``); both must send this rank the rest in one
        order, or no order can be agreed (refused, never a hang)."""
        if not self.transport.needs_order:
            return
        m = self._m

        def kept(key: MessageKey) -> bool:
            return key[2] // m <= last_step

        if shorter is not None:
            cut = {r: [s[0] for s in o if kept(s[0])] for r, o in self.agreed_order(before).items()}
            own = {r: [s[0] for s in o] for r, o in self.agreed_order(shorter).items()}
            if {r: o for r, o in cut.items() if o} != own:
                raise RuntimeError(
                    f"rank {self.rank}: after the stop at step {last_step}, the segment cut "
                    f"short and the shorter segment's own schedule send this rank its messages "
                    f"in different orders, so no posting order can be agreed over NCCL (or "
                    f"with one tag); run without a stopping callback, or on gloo with a tag "
                    f"per message"
                )
        self.transport.forget(kept)

    def _post_ahead(self) -> None:
        if not self._posts_receives:
            return
        # no receive past a stop decision not yet taken: it might never be sent
        limits = self._gates or self.post_limits
        horizon = limits[0][1] if limits else None
        for a in self._actions[self._pos : self._pos + LOOKAHEAD]:
            if horizon is not None and self._first + step_of(a, self._m) > horizon:
                break
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                spec = self._recv_spec(a)
                if len(spec) == 4:
                    self.transport.post_recv(*spec)
                else:
                    self.transport.post_recv_parts(*spec)
            elif self._needs_target_message(a):
                target = self._target_spec(a.mb)
                if len(target) == 4:
                    self.transport.post_recv(*target)
                else:
                    self.transport.post_recv_parts(*target)
