"""Where a pipeline's stages run: the device of this process and, for the ``dist``
transport, its place in the ``torch.distributed`` process group.

One rank per stage (of each data-parallel replica): under ``torchrun`` (or any launcher
that sets ``RANK``/``WORLD_SIZE``) the group is started here with NCCL on GPUs and gloo on
CPU, unless the caller (the ``pipeoptim train`` launcher, a user's script) already started
one.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.profile import threads_per_rank

__all__ = ["join_group", "local_device", "pick_device", "world_error"]


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """``cuda:(local_rank % count)`` where GPUs exist and are allowed, else the CPU."""
    if requested.startswith("cuda:"):
        return torch.device(requested)
    if requested not in ("auto", "cpu", "cuda"):
        raise RuntimeConfigError(f"unknown device {requested!r}; use auto, cpu, cuda or cuda:N")
    if requested == "cpu" or not torch.cuda.is_available():
        if requested == "cuda":
            raise RuntimeConfigError("device 'cuda', but torch sees no GPU; use device 'cpu'")
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def local_device(requested: str, devices: list[str] | None) -> torch.device:
    """The one device of the local transport: ``requested``, else the plan's."""
    if requested == "auto" and devices:
        if len(set(devices)) > 1:
            raise RuntimeConfigError(
                f"the plan puts ranks on several devices ({', '.join(devices)}), but the local "
                f"transport runs every stage on one; use transport 'dist'"
            )
        return torch.device(devices[0])
    return pick_device(requested)


def join_group(
    ranks: int, requested: str, devices: list[str] | None, timeout: float, *, replicas: int = 1
) -> tuple[torch.device, int, bool]:
    """(device, global rank, whether this call started the group) of this process in a group
    of ``replicas`` x ``ranks`` processes, one per pipeline rank of each replica."""
    started = False
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeConfigError(
                f"transport 'dist' runs one process per stage: launch the script with "
                f"`torchrun --nproc-per-node {ranks} SCRIPT` or call "
                f"torch.distributed.init_process_group first; transport 'local' runs every "
                f"stage in this process"
            )
        world = int(os.environ["WORLD_SIZE"])
        if world != ranks * replicas:  # before the rendezvous, so nothing waits
            raise world_error(world, ranks, replicas)
        device = pick_device(requested, int(os.environ.get("LOCAL_RANK", "0")))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        started = True
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != ranks * replicas:
        raise world_error(world, ranks, replicas)
    if requested == "auto" and devices and len(devices) == ranks:
        device = torch.device(devices[rank % ranks])
    elif requested == "auto" and dist.get_backend() != "nccl":
        device = torch.device("cpu")
    else:
        device = pick_device(requested, int(os.environ.get("LOCAL_RANK", rank)))
    return device, rank, started


def world_error(world: int, ranks: int, replicas: int = 1) -> RuntimeConfigError:
    """The world size is not pipeline ranks x replicas: what to launch instead."""
    if replicas == 1:
        return RuntimeConfigError(
            f"world size {world} does not match the plan's {ranks} pipeline stages (dist runs "
            f"one process per stage); launch {ranks} processes (torchrun --nproc-per-node "
            f"{ranks}) or use {world} stages"
        )
    need = ranks * replicas
    fits = world % ranks == 0
    return RuntimeConfigError(
        f"world size {world} does not match {replicas} replicas x {ranks} pipeline ranks = "
        f"{need} processes (dist runs one process per stage of each replica); launch {need} "
        f"processes (e.g. torchrun --nnodes {replicas} --nproc-per-node {ranks})"
        + (f" or use --data-parallel {world // ranks}" if fits else "")
    )


def rank_threads(ranks: int) -> int:
    """CPU threads of each of ``ranks`` processes sharing this machine: the cores split
    evenly (what spawned ranks use, and what a profile for them should be taken with)."""
    return threads_per_rank(ranks)
