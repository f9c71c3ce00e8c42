"""The rules of data-parallel replicas (PP x DP), shared by the planner, the simulator and
the runtime: a replica count is a whole number >= 1, and every replica trains 1/D of each
global batch in M micro-batches, so the batch must split into D x M whole parts."""

from __future__ import annotations

from pipeoptim.errors import PipeoptimError, PlanError

__all__ = ["check_batch_split", "check_replicas"]


def check_replicas(
    replicas: object, flag: str = "--data-parallel", *, error: type[PipeoptimError] = PlanError
) -> int:
    """``replicas`` as a whole number >= 1, else ``error`` naming ``flag``."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise error(
            f"{flag} must be a whole number of pipeline replicas >= 1 (got {replicas!r}); "
            f"use 1 for one pipeline, or more to train several replicas of it"
        )
    return replicas


def check_batch_split(
    batch_size: int,
    replicas: int,
    micro_batches: int,
    *,
    error: type[PipeoptimError] = PlanError,
) -> None:
    """Each of ``replicas`` replicas trains ``batch_size / replicas`` samples of every batch
    in ``micro_batches`` micro-batches: the batch must be a multiple of their product."""
    b, d, m = batch_size, replicas, micro_batches
    parts = d * m
    if b % parts == 0:
        return
    near = max(parts, b // parts * parts)
    if d == 1:
        raise error(
            f"batch size {b} is not divisible by {m} micro-batches; use a batch size of "
            f"{near}, or a micro-batch count that divides {b}"
        )
    raise error(
        f"batch size {b} is not divisible by {d} replicas x {m} micro-batches (each replica "
        f"trains 1/{d} of every batch, in {m} micro-batches); use a batch size of {near}, or "
        f"fewer replicas or micro-batches"
    )
