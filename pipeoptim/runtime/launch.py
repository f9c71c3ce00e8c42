"""Start a training run: in this process, as P (x D replicas) spawned processes, or as one
torchrun rank.

``train(config, runner)`` starts the run of ``pipeoptim train``; every path ends in
:func:`run_config`, which has the :class:`Runner` build a
:class:`~pipeoptim.runtime.pipeline.Pipeline` from the config and calls ``fit``, as a library
user's script would. The runner comes from the package that knows the config's model
(:mod:`pipeoptim.workloads.train`): this module starts, connects and watches processes and
never builds a model itself, so the runtime does not depend on the built-in workloads.

* ``transport="local"``: every stage in this process on one device (cuda:0 where there is
  a GPU, else the CPU); the fast path, and the one for a single GPU;
* ``transport="dist"`` under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... in
  the environment): this process is one rank, rendezvous ``env://``; rank 0 returns the
  merged result, the other ranks None;
* ``transport="dist"`` otherwise: spawns P processes on this machine (``python -m`` the
  runner's worker module, with the same torchrun-style environment and a store this process
  hosts on a free 127.0.0.1 port) and watches them.

Each rank uses cuda + NCCL where GPUs exist (device ``LOCAL_RANK % device_count``), else CPU
+ gloo, with a bounded process-group timeout. So that no run hangs: a rank that fails posts
(rank, kind, message) on the :class:`~pipeoptim.runtime.comm.failure_board.FailureBoard` and exits
non-zero; a rank that dies closes its connections, which its neighbours notice at once and
report; the launcher, seeing a child exit non-zero, posts it, gives the others a short grace
period, terminates what is left and raises an error naming the rank that failed. Results and
trace parts travel through the store, so a failed run still leaves the trace of what ran.
Under torchrun, torchrun itself stops the other ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from pipeoptim.errors import NonFiniteLossError, PipeoptimError, RankFailedError, RuntimeConfigError
from pipeoptim.runtime.comm import parent_watch
from pipeoptim.runtime.comm.failure_board import FailureBoard, lost_peer
from pipeoptim.runtime.comm.parent_watch import stop_if_orphaned, write_whole_line
from pipeoptim.runtime.comm.placement import check_device, pick_device, rank_threads, world_error
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.executor import RankResult
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.result import FitResult, build_trace, merge
from pipeoptim.trace import Trace

__all__ = [
    "Build",
    "Runner",
    "preflight",
    "run_config",
    "train",
    "worker_main",
    "write_trace",
]


def _meta(config: TrainConfig, device: str) -> dict[str, object]:
    return {"transport": config.transport, "device": device, "model": config.model}


def write_trace(trace: Trace, path: str | None) -> str | None:
    """Save ``trace`` to ``path``; on failure the reason (the run's results are kept)."""
    if not path:
        return None
    try:
        trace.save(path)
    except OSError as err:
        return f"trace not written to {path}: {err.strerror or err}"
    return None


def _save_trace(config: TrainConfig, results: list[RankResult], device: str) -> None:
    if config.trace and results:
        write_trace(build_trace(config.plan, results, _meta(config, device)), config.trace)


def _finish(config: TrainConfig, result: FitResult) -> FitResult:
    problem = write_trace(result.trace, config.trace)
    if problem:
        result.notes.append(problem)
        result.unwritten.append(config.trace or "")
    return result


class Build(Protocol):
    """Builds one process's run of a config: the Pipeline, its training data and its
    evaluation data (``store``: the run's store when this process is one rank of several)."""

    def __call__(
        self, config: TrainConfig, *, store: Store | None = None
    ) -> tuple[Pipeline, Iterable[Any], Iterable[Any]]: ...


@dataclass(frozen=True)
class Runner:
    """What the launcher needs from the package that knows a config's model."""

    build: Build
    """One process's Pipeline and data (:class:`Build`)."""
    check: Callable[[TrainConfig], None]
    """The checks every rank would fail alike (the model, its stage layout, the batch and
    the data), made once in the launcher before any process starts."""
    worker: str
    """The module each spawned rank runs (as ``__main__``, started by
    :mod:`~pipeoptim.runtime.comm.parent_watch`); its ``__main__`` is
    ``os._exit(worker_main(runner))``."""


def run_config(config: TrainConfig, runner: Runner, *, store: Store | None = None) -> FitResult:
    """Train ``config`` (``runner.build``, then ``fit``). Every path of ``pipeoptim train``
    ends here (one process, or one rank of several)."""
    pipe, train_data, test_data = runner.build(config, store=store)
    try:
        result = pipe.fit(
            train_data,
            epochs=config.epochs,
            max_steps=config.max_steps,
            eval_data=test_data,
            resume=config.resume,
        )
    except BaseException:
        if store is not None:  # the launcher writes the trace from every rank's share
            with contextlib.suppress(RuntimeError):
                store.set(f"pipeoptim/result/{dist.get_rank()}", pipe.rank_result().to_json())
        else:
            write_trace(pipe.trace(), config.trace)
        raise
    if store is not None:
        store.set(f"pipeoptim/result/{dist.get_rank()}", pipe.rank_result().to_json())
        return result
    return _finish(config, result)


def train(config: TrainConfig, runner: Runner) -> FitResult | None:
    """Run ``config``; returns the merged result (None on torchrun ranks other than 0)."""
    if ProcessModel.parse(config.transport).one_process:
        return run_config(config, runner)
    if "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "PIPEOPTIM_STORE_PORT" not in os.environ
    ):
        return _train_torchrun(config, runner)
    return _spawn(config, runner)


def preflight(config: TrainConfig, runner: Runner) -> None:
    """The checks every rank would fail alike, made once before any process starts."""
    runner.check(config)
    if config.device.startswith("cuda"):  # every rank would refuse it alike
        pick_device(config.device)
    if config.device == "auto":  # the plan's devices are used, unless --device is given
        for name in config.plan.devices or []:
            check_device(torch.device(name), " in the plan's devices")
    if config.device != "cpu" and torch.cuda.is_available():
        _check_gpus(config, _world(config))


# -- one rank of a multi-process run ----------------------------------------------------------
def _world(config: TrainConfig) -> int:
    """Processes of a dist run: one per pipeline rank of each data-parallel replica."""
    return config.plan.num_stages * config.plan.data_parallel


def _connect(config: TrainConfig, rank: int, world: int, store: Store | None) -> torch.device:
    if world != _world(config):
        raise world_error(world, config.plan.num_stages, config.plan.data_parallel)
    device = _device_of(config, rank)
    if device.type == "cuda":
        # NCCL matches a pair's messages in posting order: every method posts its receives
        # in the order agreed from the schedule (rank_messages.RankMessages.agreed_order)
        _check_gpus(config, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.timeout)
    if store is None:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        group_store = PrefixStore("pipeoptim/pg", store)
        dist.init_process_group(
            backend, store=group_store, rank=rank, world_size=world, timeout=timeout
        )
    return device


def _device_of(config: TrainConfig, rank: int) -> torch.device:
    """--device if given, else the plan's device for this rank, else automatic."""
    devices = config.plan.devices
    if config.device != "auto" or not devices:
        return pick_device(config.device, int(os.environ.get("LOCAL_RANK", rank)))
    if len(devices) != config.plan.num_stages:
        raise RuntimeConfigError(
            f"the plan lists {len(devices)} devices for {config.plan.num_stages} ranks; give "
            f"one device per rank"
        )
    mine = devices[rank % config.plan.num_stages]  # alike in every replica
    return check_device(torch.device(mine), " in the plan's devices")


def _check_gpus(config: TrainConfig, local_ranks: int) -> None:
    """NCCL cannot run two ranks on one GPU: refuse before any rendezvous."""
    count = torch.cuda.device_count()
    if config.device == "auto" and not config.plan.devices and count < local_ranks:
        raise RuntimeConfigError(
            f"--transport dist over NCCL needs one GPU per rank ({local_ranks} ranks on this "
            f"machine, {count} GPU(s)); use --device cpu (gloo), fewer --stages, or "
            f"--transport local to run every stage on one GPU"
        )


def _run_rank(config: TrainConfig, runner: Runner, rank: int, store: Store) -> FitResult:
    """One rank's run (process group up); publishes its share, after a failure too."""
    board = FailureBoard(store)
    try:
        return run_config(config, runner, store=store)
    except BaseException as err:
        # A peer lost outside the transport (a barrier or collective while the run starts)
        # is reported as one, in one line: the launcher names the rank that went.
        lost = lost_peer(err)
        message = str(err) if isinstance(err, PipeoptimError) else f"{type(err).__name__}: {err}"
        if isinstance(err, NonFiniteLossError):
            board.post(rank, "nonfinite", message, step=err.step)
        elif lost is not None and lost.peer >= 0:
            board.post(rank, "peer", str(lost), suspect=lost.peer)
        elif lost is not None:
            board.post(rank, "peer", str(lost))
        else:
            board.post(rank, "error", message)
        key = f"pipeoptim/result/{rank}"
        with contextlib.suppress(RuntimeError):  # the store may be gone with the launcher
            if not store.check([key]):
                store.set(key, RankResult([rank]).to_json())
        if lost is not None and lost is not err:
            raise lost from None
        raise


def _gather(store: Store, world: int, wait: float) -> list[RankResult]:
    keys = [f"pipeoptim/result/{r}" for r in range(world)]
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(store.check([k]) for k in keys):
        time.sleep(0.05)
    return [RankResult.from_json(store.get(k)) for k in keys if store.check([k])]


def _train_torchrun(config: TrainConfig, runner: Runner) -> FitResult | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _connect(config, rank, world, None)
    store = dist.distributed_c10d._get_default_store()
    label = f"{device.type} x{config.plan.num_stages}"
    try:
        result = _run_rank(config, runner, rank, store)
        dist.barrier()
    except BaseException:
        if rank == 0:  # replica 0's pipeline, as a finished run's trace
            _save_trace(config, _gather(store, config.plan.num_stages, 5.0), label)
        raise
    dist.destroy_process_group()
    if rank != 0:
        return None
    return _finish(config, result)


# -- the launcher -----------------------------------------------------------------------------
def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _spawn(config: TrainConfig, runner: Runner) -> FitResult:
    """Start one process per stage (of each replica) on this machine and watch them."""
    preflight(config, runner)
    p, world = config.plan.num_stages, _world(config)
    timeout = timedelta(seconds=config.timeout)
    # Port 0: the OS picks a free port as the store binds it, so no other process can race us.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    port = store.port
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PIPEOPTIM_STORE_PORT": str(port),
        parent_watch.LAUNCHER_PID: str(os.getpid()),
        "WORLD_SIZE": str(world),
        "PIPEOPTIM_CONFIG": config.to_json(),
    }
    # the watchdog starts before the worker imports torch (seconds on a loaded machine)
    command = [sys.executable, "-m", parent_watch.__name__, runner.worker]
    procs = [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(world)
    ]
    try:
        codes, stopped = _watch(procs, FailureBoard(store), grace=min(10.0, config.timeout))
    except BaseException:  # e.g. Ctrl-C: take the children down with us
        for proc in procs:
            proc.kill()
        raise
    results = _gather(store, p, 0.0)  # replica 0's pipeline: the trace shows one
    device = "cuda" if torch.cuda.is_available() and config.device != "cpu" else "cpu"
    label = f"{device} x{p}"
    if any(codes):
        _save_trace(config, results, label)
        error = _failure(FailureBoard(store), codes, stopped)
        if isinstance(error, NonFiniteLossError) and any(r.losses for r in results):
            error.partial = merge(config.plan, results, _meta(config, label))
        raise error
    return _finish(config, merge(config.plan, results, _meta(config, label)))


def _watch(
    procs: list[subprocess.Popen[bytes]], board: FailureBoard, grace: float
) -> tuple[list[int], set[int]]:
    """Wait for every child; after the first failure the others get ``grace`` seconds to
    stop on their own, then are terminated. Returns exit codes and the ranks we stopped."""
    codes: list[int | None] = [None] * len(procs)
    stopped: set[int] = set()
    failed_at: float | None = None
    while any(c is None for c in codes):
        for r, proc in enumerate(procs):
            rc = proc.poll() if codes[r] is None else None
            if rc is None:
                continue
            codes[r] = rc
            if rc != 0 and r not in stopped:
                board.post(r, "died", _describe_exit(rc))
                failed_at = failed_at if failed_at is not None else time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for r, proc in enumerate(procs):
                if codes[r] is None and r not in stopped:
                    stopped.add(r)
                    proc.terminate()
                elif codes[r] is None and time.monotonic() - failed_at > grace + 5:
                    proc.kill()
        time.sleep(0.05)
    return [int(c or 0) for c in codes], stopped


def _failure(board: FailureBoard, codes: list[int], stopped: set[int]) -> PipeoptimError:
    """The error naming the rank that failed first (its own record, or the one that died)."""
    record = board.read() or {"kind": "died", "message": "exited"}
    kind = record["kind"]
    if kind in ("error", "nonfinite"):
        culprit = int(record["rank"])
    else:  # it died without a word: prefer a rank killed by a signal we did not send
        killed = [r for r, c in enumerate(codes) if c < 0 and r not in stopped]
        failed = next(r for r, c in enumerate(codes) if c)
        culprit = killed[0] if killed else int(record.get("suspect", record.get("rank", failed)))
    if kind == "nonfinite":
        return NonFiniteLossError(f"rank {culprit}: {record['message']}", int(record["step"]))
    cause = record["message"] if kind == "error" else _describe_exit(codes[culprit])
    exits = ", ".join(f"rank {r} {_describe_exit(c)}" for r, c in enumerate(codes) if c)
    return RankFailedError(
        f"rank {culprit} failed: {cause}; the run was stopped on every rank ({exits})", culprit
    )


def worker_main(runner: Runner) -> int:
    """A spawned child (``runner.worker``'s ``__main__``): one rank, connected to the store
    its launcher hosts; returns the exit status. Its start
    (:mod:`~pipeoptim.runtime.comm.parent_watch`) already watches the launcher."""
    config = TrainConfig.from_json(os.environ["PIPEOPTIM_CONFIG"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores; torchrun sets it to 1
        torch.set_num_threads(rank_threads(world))
    port = int(os.environ["PIPEOPTIM_STORE_PORT"])
    timeout = timedelta(seconds=config.timeout)
    store = TCPStore(os.environ["MASTER_ADDR"], port, is_master=False, timeout=timeout)
    code = 0
    try:
        _connect(config, rank, world, store)
        _run_rank(config, runner, rank, store)
        dist.barrier()  # nobody leaves while a peer may still be reading from it
    except PipeoptimError as err:
        stop_if_orphaned()  # the launcher went: say that, not what it did to a peer
        write_whole_line(f"pipeoptim train: rank {rank}: {err}")
        code = 1
    except BaseException:
        # a peer that stopped because the launcher died resets this rank's connections,
        # here while the process group connects too: end with the watchdog's line, as the
        # exception hook does for an uncaught error, not with the backend's traceback
        stop_if_orphaned()
        write_whole_line(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code
