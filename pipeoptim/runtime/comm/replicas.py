"""Data-parallel replicas of a pipeline (PP x DP): D copies of a P-stage pipeline.

The D x P processes form a ``torch.distributed`` DeviceMesh of shape (D, P), dimensions
``("dp", "pp")``: global rank ``replica * P + pipeline_rank``, so the ranks of one pipeline
are contiguous (on one node where a node holds them). Every replica runs the same schedule
on its own 1/D of every batch; before each update the D replicas of a stage average their
gradients with one all-reduce over the stage's ``dp`` group (:class:`GradientAverager`,
called by ``Stage.update`` before the optimizer step). The replicas therefore hold the same
weights and optimizer state at every step, and weight prediction, which reads only those,
needs no change.

The all-reduce is blocking and sits inside the update action: every method's next forward on
the stage reads the weights that update writes, so there is nothing to overlap it with. The
simulator models it the same way (``pipeoptim.sim.collectives``).

Buffers (BatchNorm's running statistics) are not gradients: each replica's forwards move
them on its own shard, so they would drift apart. At each update replica 0's buffers are
broadcast to the other replicas (:class:`BufferBroadcast`, one flat message per stage, only
for stages that hold floating-point buffers), so they are equal after every update and every
replica evaluates alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeoptim.errors import PeerLostError

__all__ = [
    "BUCKET_BYTES",
    "BufferBroadcast",
    "GradientAverager",
    "ReplicaGroups",
    "ReplicaMax",
    "collective",
    "gather_over_replicas",
]

BUCKET_BYTES = 25 * 2**20
"""Gradients are all-reduced in flat buckets of at most this many bytes (DDP's default):
few collectives, and at most one bucket of extra memory."""


@dataclass(frozen=True)
class ReplicaGroups:
    """This process's place in the (D, P) mesh and the process groups it talks over."""

    replicas: int
    """D: replicas of the pipeline."""
    replica: int
    """This process's replica (its row of the mesh)."""
    pipeline_ranks: int
    """P: ranks of one pipeline (the mesh's columns)."""
    pipeline_group: dist.ProcessGroup | None
    """The ranks of this replica's pipeline (None: the whole world, D = 1)."""
    data_group: dist.ProcessGroup | None
    """This pipeline rank's D replicas (None: no replicas, D = 1)."""

    def global_rank(self, pipeline_rank: int) -> int:
        """The process-group rank of ``pipeline_rank`` in this replica."""
        return self.replica * self.pipeline_ranks + pipeline_rank

    @classmethod
    def single(cls, pipeline_ranks: int) -> ReplicaGroups:
        return cls(1, 0, pipeline_ranks, None, None)

    @classmethod
    def build(cls, replicas: int, pipeline_ranks: int, device: torch.device) -> ReplicaGroups:
        """The mesh of the initialised world (every rank must call this, in the same order)."""
        if replicas == 1:
            return cls.single(pipeline_ranks)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device.type, (replicas, pipeline_ranks), mesh_dim_names=("dp", "pp")
        )
        replica = dist.get_rank() // pipeline_ranks
        return cls(replicas, replica, pipeline_ranks, mesh.get_group("pp"), mesh.get_group("dp"))

    def broadcast_weights(self, modules: Sequence[nn.Module]) -> None:
        """Replica 0's parameters and buffers to every replica, as DDP does at start: the
        replicas must begin identical, whatever seed each process built its model with."""
        if self.data_group is None:
            return
        source = dist.get_global_rank(self.data_group, 0)
        with torch.no_grad():
            for module in modules:
                for tensor in [*module.parameters(), *module.buffers()]:
                    with collective(self.data_group, "copying replica 0's weights"):
                        dist.broadcast(tensor.data, src=source, group=self.data_group)


@contextmanager
def collective(group: dist.ProcessGroup, what: str) -> Iterator[None]:
    """Around a collective over ``group``: a replica that died or stopped surfaces as
    :class:`PeerLostError` (as a lost pipeline neighbour does), so the launcher names the
    rank that failed, not this one."""
    try:
        yield
    except RuntimeError as err:
        ranks = dist.get_process_group_ranks(group)
        others = [r for r in ranks if r != dist.get_rank()]
        raise PeerLostError(
            f"lost a replica (ranks {ranks}) while {what}: {str(err).splitlines()[0][:200]}",
            others[0] if others else ranks[0],
        ) from None


class GradientAverager:
    """Average the gradients of one stage over its D replicas (sum, then divide by D)."""

    def __init__(self, group: dist.ProcessGroup, replicas: int) -> None:
        self.group = group
        self.replicas = replicas

    def __call__(self, params: Sequence[Tensor]) -> None:
        for bucket in _buckets(params):
            # One flag per parameter rides along: a gradient none of the replicas computed
            # stays None (the optimizer skips it) instead of becoming zeros.
            present = [p.grad is not None for p in bucket]
            pieces = [
                p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket
            ]
            flags = torch.tensor(present, dtype=bucket[0].dtype, device=bucket[0].device)
            flat = torch.cat([*pieces, flags])
            with collective(self.group, "averaging gradients"):
                dist.all_reduce(flat, group=self.group)
            flat.div_(self.replicas)
            offset = 0
            for i, p in enumerate(bucket):
                n = p.numel()
                piece = flat[offset : offset + n].view_as(p)
                offset += n
                if p.grad is not None:
                    p.grad.copy_(piece)
                elif bool(flat[-len(bucket) + i] > 0):
                    p.grad = piece.clone()


class ReplicaMax:
    """The element-wise max of a tensor over one stage's D replicas, in place (QK-Clip's
    per-head max logit: each replica's forwards saw its own share of the batch, and every
    replica must clip alike to keep one set of weights). One all-reduce per call."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, tensor: Tensor) -> None:
        with collective(self.group, "taking the max logit over replicas"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)


class BufferBroadcast:
    """Replica 0's buffers of one stage to its other replicas, called at each update.

    Why a broadcast, not an average: it is DDP's rule (``broadcast_buffers``, there before
    each forward), it is defined for every buffer (an average of an integer counter, a mask
    or an RNG state is not), it keeps integer buffers such as ``num_batches_tracked`` exact,
    and it leaves every replica with replica 0's bytes. Why at the update, not before each
    forward: under the asynchronous methods a stage runs forwards of several mini-batches
    between two updates, in an order every replica shares only at the update (the schedule's
    ``U``); a training forward normalises with the batch's own statistics, so the running
    ones matter only to evaluation, which follows a drain, after the stage's last update.
    Cost: one broadcast of the stage's buffer bytes per update (BatchNorm: 2 floats and one
    integer per feature), flattened into one message whatever their dtypes.
    """

    def __init__(self, group: dist.ProcessGroup, module: nn.Module) -> None:
        self.group = group
        self.module = module
        self.source = dist.get_global_rank(group, 0)

    @staticmethod
    def needed(module: nn.Module) -> bool:
        """Whether ``module`` holds a floating-point buffer (statistics that move in the
        forward); buffers that are all integer (position ids, masks) are constants."""
        return any(b.is_floating_point() for b in module.buffers())

    def __call__(self) -> None:
        # Read the buffers at each call: a module may re-assign one (``.to()`` does).
        # Widest elements first, so each one's bytes start aligned for its dtype's view.
        buffers = sorted(self.module.buffers(), key=lambda b: -b.element_size())
        if not buffers:
            return
        with torch.no_grad():
            flat = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in buffers])
            with collective(self.group, "copying replica 0's buffers"):
                dist.broadcast(flat, src=self.source, group=self.group)
            if dist.get_rank() == self.source:
                return
            offset = 0
            for b in buffers:
                n = b.numel() * b.element_size()
                # Through .data: graphs still in flight (an asynchronous method's later
                # forwards) saved the running statistics, which a training backward never
                # reads; a tracked write would fail their version check.
                b.data.copy_(flat[offset : offset + n].view(b.dtype).view(b.shape))
                offset += n


def gather_over_replicas(groups: ReplicaGroups, obj: Any, what: str) -> list[Any]:
    """``obj`` of every replica (in replica order), on every rank: gathered from this
    pipeline rank's replicas. ``[obj]`` when there are no replicas."""
    group = groups.data_group
    if group is None:
        return [obj]
    out: list[Any] = [None] * groups.replicas
    with collective(group, what):
        dist.all_gather_object(out, obj, group=group)
    return out


def _buckets(params: Sequence[Tensor]) -> list[list[Tensor]]:
    """Consecutive parameters of one dtype and device, at most BUCKET_BYTES each (a larger
    parameter is a bucket of its own)."""
    out: list[list[Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = out[-1] if out else None
        same = last is not None and last[0].dtype == p.dtype and last[0].device == p.device
        if last is None or not same or size + nbytes > BUCKET_BYTES:
            out.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return out
