"""Where a pipeline's ranks live: every stage in this process, or one process per stage.

The process model is apart from the transport class that carries the messages: the Pipeline,
the assembly, the fit loop and the launcher ask the process model what to do (share a value,
join a process group, spawn processes), and :meth:`ProcessModel.transports` is the one place
that picks the transport class for it. A new transport is a new class in ``comm/``; a new
process model is a new value here, checked by :meth:`ProcessModel.parse`.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from pipeoptim.errors import RuntimeConfigError

if TYPE_CHECKING:
    import torch

    from pipeoptim.runtime.comm.transport import Transport

__all__ = ["ProcessModel"]


class ProcessModel(str, Enum):
    """A run's process model, by the name users give it (``transport="local"`` or
    ``"dist"``, ``--transport``): a ``str``, so configs, traces and checkpoints keep the
    name."""

    ONE_PROCESS = "local"
    """Every stage in this process on one device; messages are mailbox entries."""
    PROCESS_PER_STAGE = "dist"
    """One process per pipeline rank (spawned here, or ``torchrun``'s), in a
    ``torch.distributed`` process group; messages are point-to-point operations."""

    @classmethod
    def parse(cls, value: object) -> ProcessModel:
        """``value`` as a process model, or the error naming the known ones."""
        for model in cls:
            if value == model.value:
                return model
        known = " or ".join(m.value for m in cls)
        raise RuntimeConfigError(f"unknown transport {value!r}; use {known}")

    @property
    def one_process(self) -> bool:
        """Every rank lives in this process."""
        return self is ProcessModel.ONE_PROCESS

    def transports(
        self,
        num_ranks: int,
        own_rank: int,
        device: torch.device,
        first_rank: int,
        timeout: float,
        *,
        one_tag: bool = False,
        num_stages: int | None = None,
        varying_shapes: bool = False,
    ) -> dict[int, Transport]:
        """This process's transport endpoint of each rank it runs: all ``num_ranks`` sharing
        a mailbox in one process, or ``own_rank``'s alone over the process group
        (``first_rank``: the process-group rank of this pipeline's rank 0), with shared
        memory between the ranks on one host where the group is gloo's (``timeout``:
        seconds a wait for a peer may last; ``one_tag``: every gloo message under one tag,
        ``CommOptions.one_tag``; ``num_stages``: the pipeline's stages, which the message
        tags count in, where a rank holds several; ``varying_shapes``: each message
        carries its shape, ``CommOptions.varying_shapes``)."""
        # imported here: the run configuration checks a process model without loading torch
        if self.one_process:
            from pipeoptim.runtime.comm.local import LocalTransport

            return dict(enumerate(LocalTransport.group(num_ranks)))
        import torch.distributed as dist

        from pipeoptim.runtime.comm.dist import DistTransport
        from pipeoptim.runtime.comm.shared_memory import (
            SharedMemoryTransport,
            shared_memory_ring_bytes,
        )

        ring = shared_memory_ring_bytes()
        if ring and dist.get_backend() == "gloo":
            return {
                own_rank: SharedMemoryTransport(
                    own_rank,
                    num_ranks,
                    device,
                    first_rank=first_rank,
                    timeout=timeout,
                    ring_bytes=ring,
                    one_tag=one_tag,
                    tag_stages=num_stages,
                    varying_shapes=varying_shapes,
                )
            }
        return {
            own_rank: DistTransport(
                own_rank,
                num_ranks,
                device,
                first_rank=first_rank,
                one_tag=one_tag,
                tag_stages=num_stages,
                varying_shapes=varying_shapes,
            )
        }
