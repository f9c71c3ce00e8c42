"""Where a pipeline's stages run: the device of this process and, for the ``dist``
transport, its place in the ``torch.distributed`` process group.

One rank per stage (of each data-parallel replica): under ``torchrun`` (or any launcher
that sets ``RANK``/``WORLD_SIZE``) the group is started here with NCCL on GPUs and gloo on
CPU, unless the caller (the ``pipeoptim train`` launcher, a user's script) already started
one.

A rank whose launcher dies must not train on as an orphan: the watchdog
(:mod:`~pipeoptim.runtime.comm.parent_watch`) ends it within half a second of the launcher's
death, with one line. The ``pipeoptim train`` launcher's children install it before they
import anything heavy; a library run under torchrun installs it here, as it joins the group
(the torchrun agent is every rank's parent, and a ``kill -9`` of it tells no one).
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.profile import threads_per_rank
from pipeoptim.runtime.comm.parent_watch import exit_with_parent

__all__ = [
    "check_device",
    "join_group",
    "local_device",
    "pick_device",
    "start_group",
    "under_torchrun",
    "world_error",
]


def _no_gpu(requested: str, where: str = "") -> RuntimeConfigError:
    """Why ``requested`` (a cuda device) cannot be had here: no CUDA in this torch, or no
    GPU that it sees."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:  # no GPU build
        return RuntimeConfigError(
            f"device {requested!r}{where}, but this torch build has no CUDA (torch "
            f"{torch.__version__}, CPU only); use device 'cpu' (or 'auto'), or install a CUDA "
            f"build of torch"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return RuntimeConfigError(
        f"device {requested!r}{where}, but torch sees no GPU{hidden}; use device 'cpu' (or "
        f"'auto'), or run where a GPU and its driver are visible"
    )


def check_device(device: torch.device, where: str = "") -> torch.device:
    """``device`` if this process can use it: a cuda device needs CUDA in this torch build,
    a visible GPU, and an index below the GPU count (torch itself fails later with a bare
    ``AssertionError`` or "invalid device ordinal"). ``where`` follows the device's name in
    the error (" in the plan's devices")."""
    if device.type != "cuda":
        return device
    name = str(device)
    if not torch.cuda.is_available():
        raise _no_gpu(name, where)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise RuntimeConfigError(
            f"device {name!r}{where} is out of range: this machine has {count} GPU(s) (cuda:0 to "
            f"cuda:{count - 1}); use one of those, 'cuda' (each rank takes LOCAL_RANK mod "
            f"{count}), or device 'cpu'"
        )
    return device


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """``cuda:(local_rank % count)`` where GPUs exist and are allowed, else the CPU; a given
    ``cuda:N`` is checked (:func:`check_device`)."""
    if requested.startswith("cuda:"):
        index = requested.removeprefix("cuda:")
        if not index.isdigit():
            raise RuntimeConfigError(
                f"unknown device {requested!r}; use auto, cpu, cuda or cuda:N (N a GPU index)"
            )
        return check_device(torch.device("cuda", int(index)))
    if requested not in ("auto", "cpu", "cuda"):
        raise RuntimeConfigError(f"unknown device {requested!r}; use auto, cpu, cuda or cuda:N")
    if requested == "cpu" or not torch.cuda.is_available():
        if requested == "cuda":
            raise _no_gpu(requested)
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
        return check_device(torch.device(devices[0]), " in the plan's devices")
    return pick_device(requested)


_GROUPS_STARTED = itertools.count()
"""Process groups this process started (every rank starts them in the same order)."""


def start_group(backend: str, timeout: timedelta) -> None:
    """Start the default process group from the launcher's environment (``env://``).

    Why a prefix of its own for every group after the first: the launcher's store outlives
    a group, and a group started after ``destroy_process_group`` (a second Pipeline after
    ``close()``) gets the first one's name again, so its ranks could read the addresses the
    first group's ranks published there, and gloo's connect to those fails ("Connection
    refused") whenever a rank looks before its peer wrote the new one."""
    started = next(_GROUPS_STARTED)
    if started == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        backend,
        store=PrefixStore(f"pipeoptim-group-{started}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


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
        start_group(backend, timedelta(seconds=timeout))
        started = True
    rank, world = dist.get_rank(), dist.get_world_size()
    if under_torchrun():  # never for the local transport, which joins no group
        agent = os.getppid()
        exit_with_parent(
            agent,
            f"pipeoptim: rank {rank}: torchrun (pid {agent}), which started this process, is "
            f"gone; stopping",
        )
    if world != ranks * replicas:
        raise world_error(world, ranks, replicas)
    if requested == "auto" and devices and len(devices) == ranks:
        mine = devices[rank % ranks]
        device = check_device(torch.device(mine), " in the plan's devices")
    elif requested == "auto" and dist.get_backend() != "nccl":
        device = torch.device("cpu")
    else:
        device = pick_device(requested, int(os.environ.get("LOCAL_RANK", rank)))
    return device, rank, started


def under_torchrun() -> bool:
    """Whether a torchrun (torch.distributed.elastic) agent started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


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
