"""Parameters shared by units on different stages (a tied embedding): one weight, kept exact.

A model may use one ``Parameter`` in two places (GPT-2's input embedding is its output
projection). Inside one stage that is plain autograd. Across stages it is two stages'
parameter, and without care two optimizers step one tensor (one process) or every rank trains
its own copy and the copies drift (one process per stage).

The rule, as Megatron-LM keeps its embedding group: every stage holding the weight keeps its
own copy (in one process the later stages get a clone, so one process computes exactly what
one process per stage does); at each update the member stages exchange their gradients of the
weight, each adds them in stage order (so every copy gets the bitwise-same sum) and steps its
copy with that sum. Copies that start equal and take equal steps stay equal, and the update is
the single-process one: the weight's gradient is the sum of its uses'.

Only synchronous (flush) methods can keep this promise at no cost: they update every stage
between the same two mini-batches. An asynchronous stage's k-th update applies the gradient of
a mini-batch whose other use is a whole pipeline away, so an exact sum would make the stage
wait for it every step (the pipeline runs at one mini-batch in flight, slower than a flush),
and any cheaper rule trains two different weights. Those methods refuse cross-stage ties
(:func:`refuse_for`).

Exchanged by the pipeline's own transport (one point-to-point message each way per update,
``("tie", receiving stage, step·P + sender)``), so the single-process and the one-process-per-
stage runs share the code, and a rank waits only for its partner's update of the same step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import FLUSHING, Method
from pipeoptim.runtime.comm.transport import MessageKey, Transport

__all__ = ["Tie", "TieExchange", "find_ties", "refuse_for", "refuse_mixed_streams", "untie_copies"]


@dataclass(frozen=True)
class Tie:
    """One parameter used by units of several stages."""

    index: int
    """Its position among the model's ties (the same on every process: messages name it)."""
    label: str
    """How the error messages name it: its first unit and key, ``unit 0 (Embedding).weight``."""
    places: tuple[tuple[int, int, str], ...]
    """Each use: (stage, unit, name under the unit), in unit order."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def stages(self) -> tuple[int, ...]:
        """The member stages, ascending."""
        return tuple(sorted({s for s, _, _ in self.places}))

    def describe(self) -> str:
        uses = ", ".join(f"stage {s} (unit {u}, {n!r})" for s, u, n in self.places)
        return f"{self.label} {list(self.shape)} is used on {uses}"


def find_ties(units: Sequence[nn.Module], bounds: Sequence[tuple[int, int]]) -> list[Tie]:
    """The parameters that units of more than one stage hold: the same ``Parameter``, or two
    parameters that are the same view of one storage. Two parameters sharing storage in other
    views (a slice, a transpose) cannot be one weight per stage and are refused."""
    stage_of = {u: k for k, (a, b) in enumerate(bounds) for u in range(a, b)}
    seen: dict[int, tuple[Tensor, list[tuple[int, int, str]]]] = {}
    over: dict[int, list[int]] = {}  # storage start -> the parameters over it (meta: none)
    for u, unit in enumerate(units):
        for name, p in unit.named_parameters(remove_duplicate=False):
            key = id(p)
            where = (stage_of[u], u, name)
            if key not in seen:
                start = None if p.is_meta else p.untyped_storage().data_ptr()
                neighbours = over.get(start, []) if start is not None else []
                alias = next((k for k in neighbours if _same_view(seen[k][0], p)), None)
                if alias is not None:
                    key = alias
                else:
                    _refuse_overlap(p, where, [seen[k] for k in neighbours], units)
                    seen[key] = (p, [])
                    if start is not None:
                        over.setdefault(start, []).append(key)
            seen[key][1].append(where)
    ties: list[Tie] = []
    for q, places in seen.values():
        if len({s for s, _, _ in places}) > 1:
            _, u, n = places[0]
            label = f"unit {u} ({type(units[u]).__name__}).{n}"
            ties.append(Tie(len(ties), label, tuple(places), tuple(q.shape), q.dtype))
    return ties


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
    )


def _refuse_overlap(
    p: Tensor,
    where: tuple[int, int, str],
    neighbours: Sequence[tuple[Tensor, list[tuple[int, int, str]]]],
    units: Sequence[nn.Module],
) -> None:
    """Refuse a parameter over the storage of ``neighbours`` (in another view) where one of
    them is on another stage: no per-stage copy can be kept equal to it."""
    for q, places in neighbours:
        if all(s == where[0] for s, _, _ in places):
            continue
        s, u, n = places[0]
        raise RuntimeConfigError(
            f"stage {where[0]} (unit {where[1]}, {where[2]!r}, shape {list(p.shape)}) and "
            f"stage {s} (unit {u} {type(units[u]).__name__}, {n!r}, shape {list(q.shape)}) "
            f"are different views of one storage; a weight shared across stages must be one "
            f"Parameter used in both places: share the Parameter itself, or place both units "
            f"on one stage (plan boundaries)"
        )


def refuse_for(method: Method, ties: Sequence[Tie], amp: str | None) -> None:
    """Refuse cross-stage ties where the copies could not be kept one weight."""
    if not ties:
        return
    listed = "; ".join(t.describe() for t in ties)
    if not method.keeps_one_version:
        synchronous = list(FLUSHING)
        raise RuntimeConfigError(
            f"{listed}: {method.name} updates each stage at its own time, so a weight shared "
            f"across stages would be trained as two different weights (or the pipeline would "
            f"wait a whole round trip at every update); untie it (e.g. "
            f"tie_word_embeddings=False), place all its units on one stage (plan "
            f"boundaries), or use a synchronous method ({', '.join(synchronous)}), which "
            f"keeps it exact"
        )
    if amp == "fp16":
        raise RuntimeConfigError(
            f"{listed}: fp16 loss scaling skips steps stage by stage, so the stages' copies "
            f"of a shared weight would drift apart; use amp='bf16' (no loss scaling), or untie"
        )


def refuse_mixed_streams(method: Method, ties: Sequence[Tie], rank_of: Mapping[int, int]) -> None:
    """Where messages are matched in posting order (NCCL, or gloo with one tag), refuse ties
    that make one pair of ranks carry the shared-weight gradients of two pairs of stages in
    one direction: each stage posts its share when its own backward ends, and the receiving
    update takes them in stage order, so the two ends could post them in different orders.
    One pair of stages per pair of ranks (an embedding and its output projection, two
    stages per rank included) posts in step order on both ends."""
    streams: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for tie in ties:
        for a in tie.stages:
            for b in tie.stages:
                if rank_of[a] != rank_of[b]:
                    streams.setdefault((rank_of[a], rank_of[b]), set()).add((a, b))
    for (sender, receiver), pairs in sorted(streams.items()):
        if len(pairs) > 1:
            listed = "; ".join(t.describe() for t in ties)
            raise RuntimeConfigError(
                f"{listed}: under {method.name} rank {sender} would send rank {receiver} the "
                f"shared-weight gradients of {len(pairs)} pairs of stages "
                f"({', '.join(f'{a} to {b}' for a, b in sorted(pairs))}), whose posting "
                f"order NCCL (or one tag) cannot match; place the shared weight's units on "
                f"two stages, use one stage per rank, or --transport local"
            )


def untie_copies(
    units: Sequence[nn.Module], ties: Sequence[Tie], held: set[int]
) -> dict[int, list[tuple[Tie, nn.Parameter]]]:
    """Give every member stage this process holds its own copy of each tie: the first held
    member stage keeps the Parameter, every other one gets a clone in its units (one per
    stage, so a stage that uses it twice still holds one). A clone, not a check of identity:
    two Parameters over one storage are one tensor too. Returns, per held stage, its ties and
    the Parameter that stage trains. Only held stages are touched, so a rank never holds
    another rank's stage's copy."""
    mine: dict[int, list[tuple[Tie, nn.Parameter]]] = {}
    for tie in ties:
        keeper: int | None = None  # the first held member stage: it keeps the Parameter
        trained: dict[int, nn.Parameter] = {}  # stage -> the Parameter it trains
        for stage, u, name in tie.places:
            if stage not in held:
                continue
            owner, attr = _owner(units[u], name)
            param = owner._parameters[attr]
            assert isinstance(param, nn.Parameter)
            keeper = stage if keeper is None else keeper
            if stage not in trained:
                trained[stage] = (
                    param
                    if stage == keeper
                    else nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                )
                mine.setdefault(stage, []).append((tie, trained[stage]))
            owner._parameters[attr] = trained[stage]
    return mine


def _owner(unit: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (unit.get_submodule(path) if path else unit), attr


class TieExchange:
    """At each update of a member stage: send its gradients of its ties to the other member
    stages, take theirs, and set every tied gradient to the sum in stage order. At the start,
    every copy takes the first member stage's value (:meth:`align`). Messages between stages
    of this process stay in a mailbox here; the others go by ``transport`` (under NCCL on a
    process group of their own, since NCCL matches a pair's messages in posting order and
    these come between the activations and gradients)."""

    def __init__(
        self,
        held: Mapping[int, Sequence[tuple[Tie, nn.Parameter]]],
        num_stages: int,
        rank_of: Mapping[int, int],
        transport: Transport | None,
        here: set[int],
    ) -> None:
        self.held = {k: list(v) for k, v in held.items() if v}
        """Per stage this process holds, its ties and the Parameter it trains."""
        exchanged = {k: [(t, p) for t, p in v if p.requires_grad] for k, v in self.held.items()}
        self.mine = {k: v for k, v in exchanged.items() if v}
        """Per stage, the ties whose gradients are exchanged (frozen ones are only aligned)."""
        self.num_stages = num_stages
        self.rank_of = dict(rank_of)
        self.transport = transport
        self.here = set(here)
        """The ranks of this process: messages between them never leave it."""
        self._box: dict[MessageKey, Tensor] = {}
        self._posted: set[tuple[int, int]] = set()  # (stage, step) whose gradients were sent
        self._done: dict[tuple[int, int], int] = {}  # (stage, step) -> micro-batches in
        for stage, entries in self.mine.items():
            dtypes = {p.dtype for _, p in entries}
            if len(dtypes) > 1:
                raise RuntimeConfigError(
                    f"stage {stage} shares weights of several dtypes with other stages "
                    f"({sorted(str(d) for d in dtypes)}); cast the model to one dtype"
                )

    # -- messages: a mailbox within this process, the transport between processes ---------
    def _send(self, value: Tensor, receiver: int, key: MessageKey) -> None:
        if self.rank_of[receiver] in self.here:
            self._box[key] = value.detach()
            return
        assert self.transport is not None
        self.transport.send(value, self.rank_of[receiver], key)

    def _arrived(self, key: MessageKey, sender: int) -> bool:
        if self.rank_of[sender] in self.here:
            return key in self._box
        assert self.transport is not None
        return self.transport.ready(key)

    def _take(
        self, key: MessageKey, sender: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor:
        if self.rank_of[sender] in self.here:
            return self._box.pop(key)
        assert self.transport is not None
        return self.transport.recv(key, self.rank_of[sender], shape, dtype)

    def align(self) -> None:
        """Every held copy takes the value of the tie's first member stage (which may be on
        another process): the copies start equal whatever each process initialised."""
        # stage order: in one process the first member's send comes before the others' receives
        for stage, tie, p in sorted(
            ((k, t, p) for k, v in self.held.items() for t, p in v), key=lambda e: e[0]
        ):
            first = tie.stages[0]
            if stage == first:
                for other in tie.stages[1:]:
                    self._send(p.detach(), other, ("tie", other, -1 - tie.index))
            else:
                key: MessageKey = ("tie", stage, -1 - tie.index)
                value = self._take(key, first, tuple(p.shape), p.dtype)
                with torch.no_grad():
                    p.copy_(value)

    def holds(self, stage: int) -> bool:
        return stage in self.mine

    def _partners(self, stage: int) -> list[int]:
        return sorted({m for tie, _ in self.mine[stage] for m in tie.stages} - {stage})

    def _shared(self, stage: int, partner: int) -> list[tuple[Tie, Tensor]]:
        return [(t, p) for t, p in self.mine[stage] if partner in t.stages]

    def _key(self, receiver: int, sender: int, step: int) -> MessageKey:
        return ("tie", receiver, step * self.num_stages + sender)

    def post(self, stage: int, step: int) -> None:
        """Send ``stage``'s tied gradients of ``step`` to its partners (once)."""
        if (stage, step) in self._posted:
            return
        self._posted.add((stage, step))
        for partner in self._partners(stage):
            flat = torch.cat([_grad(p).reshape(-1) for _, p in self._shared(stage, partner)])
            self._send(flat, partner, self._key(partner, stage, step))

    def gradient_done(self, stage: int, step: int, micro_batches: int) -> None:
        """One more micro-batch of ``step`` has its weight gradients in on ``stage``; with
        the last one, send them. Sent before the stage's update, so member stages on one
        rank, whose updates come in stage order, never wait for each other."""
        done = self._done.get((stage, step), 0) + 1
        if done < micro_batches:
            self._done[(stage, step)] = done
            return
        self._done.pop((stage, step), None)
        self.post(stage, step)

    def ready(self, stage: int, step: int) -> bool:
        """Whether every partner's gradients of ``step`` have arrived."""
        return all(
            self._arrived(self._key(stage, partner, step), partner)
            for partner in self._partners(stage)
        )

    def exchange(self, stage: int, step: int) -> None:
        """Set ``stage``'s tied gradients to the members' sum (blocks on the partners)."""
        self.post(stage, step)
        self._posted.discard((stage, step))
        received: dict[int, dict[int, Tensor]] = {}  # id(tie) -> partner -> its gradient
        for partner in self._partners(stage):
            shared = self._shared(stage, partner)
            total = sum(p.numel() for _, p in shared)
            key = self._key(stage, partner, step)
            flat = self._take(key, partner, (total,), shared[0][1].dtype)
            offset = 0
            for tie, p in shared:
                part = flat[offset : offset + p.numel()].view_as(p).to(p.device)
                received.setdefault(id(tie), {})[partner] = part
                offset += p.numel()
        for tie, p in self.mine[stage]:
            parts = {stage: _grad(p), **received.get(id(tie), {})}
            total_grad = parts[tie.stages[0]].clone()
            for member in tie.stages[1:]:
                total_grad += parts[member]
            p.grad = total_grad


def _grad(p: Tensor) -> Tensor:
    """The accumulated gradient (zeros where the stage's use got none this step)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)
