"""Start a training run: in this process, as P spawned processes, or as one torchrun rank.

``train(config)`` is the one entry point:

* ``transport="local"``: every stage in this process on one device (cuda:0 where there is
  a GPU, else the CPU); the fast path, and the one for a single GPU;
* ``transport="dist"`` under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... in
  the environment): this process is one rank, rendezvous ``env://``; rank 0 returns the
  merged result, the other ranks None;
* ``transport="dist"`` otherwise: spawns P processes on this machine (``python -m
  pipeoptim.runtime.launch`` with the same torchrun-style environment and a store this
  process hosts on a free 127.0.0.1 port) and watches them.

Each rank uses cuda + NCCL where GPUs exist (device ``LOCAL_RANK % device_count``), else CPU
+ gloo, with a bounded process-group timeout. So that no run hangs: a rank that fails posts
(rank, kind, message) on the :class:`~pipeoptim.runtime.transport.FailureBoard` and exits
non-zero; a rank that dies closes its connections, which its neighbours notice at once and
report; the launcher, seeing a child exit non-zero, posts it, gives the others a short grace
period, terminates what is left and raises an error naming the rank that failed. Results and
trace parts travel through the store, so a failed run still leaves the trace of what ran.
Under torchrun, torchrun itself stops the other ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from pipeoptim.errors import PipeoptimError, RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.data import BatchOrder
from pipeoptim.runtime.executor import (
    NonFiniteLossError,
    PipelineRun,
    RankResult,
    check_batch_size,
)
from pipeoptim.runtime.models import build_model, stage_boundaries
from pipeoptim.runtime.transport import DistTransport, FailureBoard, LocalTransport, PeerLostError
from pipeoptim.trace import Trace

__all__ = [
    "DEFAULT_EPOCHS",
    "RankFailedError",
    "TrainConfig",
    "TrainResult",
    "pick_device",
    "preflight",
    "train",
]

DEFAULT_EPOCHS = 10
"""Epochs when neither ``epochs`` nor ``max_steps`` is given (the digits MLP of the default
run is past 95 % test accuracy by then)."""


class RankFailedError(RuntimeConfigError):
    """A rank of a multi-process run failed; the message names it."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def _default_plan() -> Plan:
    return Plan("pipeoptim", 4, optimizer=OptimizerSpec("sgd", 0.02))


@dataclass
class TrainConfig:
    """A training run: the plan plus what a plan does not say (length, data order, I/O).

    ``plan.model`` and ``plan.batch_size`` name the model and the samples per mini-batch
    (defaults ``mlp`` and 32).
    """

    plan: Plan = field(default_factory=_default_plan)
    epochs: int | None = None
    """Epochs to train; with ``max_steps`` also None, DEFAULT_EPOCHS."""
    max_steps: int | None = None
    """Stop after this many mini-batches in all (counted from the run's start)."""
    transport: str = "local"
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    """Also end a segment, and checkpoint, every K mini-batches (default: each epoch)."""
    resume: bool = False
    trace: str | None = None
    seed: int = 0
    device: str = "auto"
    """``auto`` (cuda where present, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    quiet: bool = True
    """No progress bar."""
    timeout: float = 300.0
    """Seconds a rank waits for another before giving up (process-group timeout)."""

    def __post_init__(self) -> None:
        self.plan.model = self.plan.model or "mlp"
        self.plan.batch_size = self.plan.batch_size or 32
        if self.epochs is None and self.max_steps is None:
            self.epochs = DEFAULT_EPOCHS
        counts = {"epochs": self.epochs, "max-steps": self.max_steps}
        counts.update({"checkpoint-every": self.checkpoint_every, "batch-size": self.batch_size})
        for flag, value in counts.items():
            if value is not None and value < 1:
                raise RuntimeConfigError(f"--{flag} must be at least 1 (got {value})")
        spec = self.plan.method_spec
        if not spec.micro_batched and self.plan.micro_batches != 1:
            spec.shape(self.plan.num_stages, self.plan.micro_batches)  # the registry's error
        if self.transport not in ("local", "dist"):
            raise RuntimeConfigError(f"unknown transport {self.transport!r}; use local or dist")
        if not self.timeout > 0:
            raise RuntimeConfigError(f"--timeout must be positive (got {self.timeout})")

    @property
    def model(self) -> str:
        return self.plan.model or "mlp"

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size or 32

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed by this run."""
        p, shape = self.plan, self.plan.shape(1)
        ident = {
            "method": p.method,
            "num_stages": p.num_stages,
            "micro_batches": shape.micro_batches,
            "virtual_stages": shape.virtual_stages,
            "prediction_offset": p.prediction_offset,
            "optimizer": asdict(p.optimizer),
            "model": self.model,
            "batch_size": self.batch_size,
            "boundaries": p.boundaries,
            "seed": self.seed,
        }
        normal: dict[str, Any] = json.loads(json.dumps(ident))  # tuples -> lists, as on disk
        return normal

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "plan": self.plan.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        d = json.loads(text)
        return cls(**{**d, "plan": Plan.from_dict(d["plan"])})


@dataclass
class TrainResult:
    """The outcome of a run, merged over its ranks."""

    method: str
    num_stages: int
    micro_batches: int
    batch_size: int
    model: str
    transport: str
    device: str
    start_step: int
    end_step: int
    losses: list[float]
    """Training loss of every mini-batch run (start_step .. end_step-1)."""
    final_loss: float
    """Mean training loss of the last (up to) 10 mini-batches."""
    train_accuracy: float
    """Training accuracy over the last (up to) one epoch of mini-batches."""
    test_accuracy: float
    samples_per_second: float
    train_seconds: float
    weight_copies: dict[int, int]
    """Peak weight copies each stage held (live, stashed or buffered, predicted)."""
    trace: Trace = field(repr=False)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("trace")
        return d


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """``cuda:(local_rank % count)`` where GPUs exist and are allowed, else the CPU."""
    if requested.startswith("cuda:"):
        return torch.device(requested)
    if requested == "cpu" or not torch.cuda.is_available():
        if requested == "cuda":
            raise RuntimeConfigError("--device cuda, but torch sees no GPU; use --device cpu")
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _device_of(config: TrainConfig, rank: int | None) -> torch.device:
    """--device if given, else the plan's device for this rank, else automatic. The local
    transport (rank None) runs every stage on one device."""
    devices = config.plan.devices
    if config.device != "auto" or not devices:
        return pick_device(config.device, int(os.environ.get("LOCAL_RANK", rank or 0)))
    if rank is None:
        if len(set(devices)) > 1:
            raise RuntimeConfigError(
                f"the plan puts ranks on several devices ({', '.join(devices)}), but the local "
                f"transport runs every stage on one; use --transport dist, or --device"
            )
        return torch.device(devices[0])
    if len(devices) != config.plan.num_stages:
        raise RuntimeConfigError(
            f"the plan lists {len(devices)} devices for {config.plan.num_stages} ranks; give "
            f"one device per rank"
        )
    return torch.device(devices[rank])


def _trace(config: TrainConfig, results: list[RankResult]) -> Trace:
    shape = config.plan.shape(1)
    start = min((r.start_step for r in results), default=0)
    meta = {
        "method": config.plan.method,
        "num_stages": shape.num_stages,
        "micro_batches": shape.micro_batches,
        "mini_batches": max((r.end_step for r in results), default=0) - start,
        "first_mini_batch": start,
        "batch_size": config.batch_size,
        "source": "runtime",
        "units": {"time": "s", "bytes": "B"},
        "transport": config.transport,
        "model": config.model,
        "plan": config.plan.to_dict(),
        # measured peak, the same key the simulator writes, so metrics compare them
        "weight_copies": {
            str(k): n
            for k, n in sorted((k, n) for r in results for k, n in r.weight_copies.items())
        },
    }
    return Trace(
        events=sorted((e for r in results for e in r.events), key=lambda e: (e.start, e.rank)),
        memory=sorted((m for r in results for m in r.memory), key=lambda m: (m.time, m.rank)),
        meta=meta,
    )


def _write_trace(config: TrainConfig, results: list[RankResult]) -> None:
    if config.trace and results:
        _trace(config, results).save(config.trace)


def _merge(config: TrainConfig, results: list[RankResult], device: str) -> TrainResult:
    last = next((r for r in results if r.test_total), results[-1])
    steps = sorted(last.losses)
    losses = [last.losses[s] for s in steps]
    window = steps[-max(1, last.steps_per_epoch) :]
    seen = len(window) * config.batch_size
    seconds = max(r.train_seconds for r in results)
    copies = {k: n for r in results for k, n in r.weight_copies.items()}
    shape = config.plan.shape(1)
    return TrainResult(
        method=config.plan.method,
        num_stages=shape.num_stages,
        micro_batches=shape.micro_batches,
        batch_size=config.batch_size,
        model=config.model,
        transport=config.transport,
        device=device,
        start_step=last.start_step,
        end_step=last.end_step,
        losses=losses,
        final_loss=sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan"),
        train_accuracy=sum(last.correct[s] for s in window) / seen if seen else float("nan"),
        test_accuracy=last.test_correct / last.test_total if last.test_total else float("nan"),
        samples_per_second=(last.end_step - last.start_step) * config.batch_size / seconds
        if seconds > 0
        else 0.0,
        train_seconds=seconds,
        weight_copies=dict(sorted(copies.items())),
        trace=_trace(config, results),
    )


def train(config: TrainConfig) -> TrainResult | None:
    """Run ``config``; returns the merged result (None on torchrun ranks other than 0)."""
    if config.transport == "local":
        return _train_local(config)
    if "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "PIPEOPTIM_STORE_PORT" not in os.environ
    ):
        return _train_torchrun(config)
    return _spawn(config)


def _train_local(config: TrainConfig) -> TrainResult:
    device = _device_of(config, None)
    transports = dict(enumerate(LocalTransport.group(config.plan.num_stages)))
    run = PipelineRun(config, transports, device, origin=time.perf_counter())
    try:
        result = run.run()
    except BaseException:
        _write_trace(config, [run.collect()])
        raise
    merged = _merge(config, [result], str(device))
    if config.trace:
        merged.trace.save(config.trace)
    return merged


def preflight(config: TrainConfig) -> None:
    """The checks every rank would fail alike, made once before any process starts."""
    layers, data = build_model(config.model, config.seed)
    shape = config.plan.shape(1)
    stage_boundaries(len(layers), shape.num_stages, config.plan.boundaries, config.model)
    check_batch_size(config.batch_size, shape.micro_batches)
    BatchOrder(len(data.train_x), config.batch_size, config.seed)
    if config.device != "cpu" and torch.cuda.is_available():
        _check_gpus(config, config.plan.num_stages)


# -- one rank of a multi-process run ----------------------------------------------------------
def _connect(config: TrainConfig, rank: int, world: int, store: Store | None) -> torch.device:
    p = config.plan.num_stages
    if world != p:
        raise RuntimeConfigError(
            f"world size {world} does not match the plan's {p} pipeline stages (dist runs "
            f"one process per stage); launch {p} processes (torchrun --nproc-per-node {p}) "
            f"or use --stages {world}"
        )
    device = _device_of(config, rank)
    if device.type == "cuda":
        _check_gpus(config, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if config.plan.method_spec.interleaved:
            raise RuntimeConfigError(
                "interleaved-1f1b over NCCL is not supported: NCCL matches messages in "
                "posting order and an interleaved pair of ranks carries two streams; use "
                "--transport local or --device cpu"
            )
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


def _check_gpus(config: TrainConfig, local_ranks: int) -> None:
    """NCCL cannot run two ranks on one GPU: refuse before any rendezvous."""
    count = torch.cuda.device_count()
    if config.device == "auto" and not config.plan.devices and count < local_ranks:
        raise RuntimeConfigError(
            f"--transport dist over NCCL needs one GPU per rank ({local_ranks} ranks on this "
            f"machine, {count} GPU(s)); use --device cpu (gloo), fewer --stages, or "
            f"--transport local to run every stage on one GPU"
        )


def _run_rank(config: TrainConfig, rank: int, store: Store, device: torch.device) -> None:
    """One rank's run (process group up); publishes its result, after a failure too."""
    board = FailureBoard(store)
    run: PipelineRun | None = None
    dist.barrier()  # a shared time origin for the trace
    try:
        transport = DistTransport(rank, config.plan.shape(1).num_stages, device)
        run = PipelineRun(
            config,
            {rank: transport},
            device,
            origin=time.perf_counter(),
            store=store,
            world_size=dist.get_world_size(),
            abort_check=board.check,
        )
        store.set(f"pipeoptim/result/{rank}", run.run().to_json())
    except BaseException as err:
        message = str(err) if isinstance(err, PipeoptimError) else f"{type(err).__name__}: {err}"
        if isinstance(err, NonFiniteLossError):
            board.post(rank, "nonfinite", message, step=err.step)
        elif isinstance(err, PeerLostError):
            board.post(rank, "peer", message, suspect=err.peer)
        else:
            board.post(rank, "error", message)
        partial = run.collect() if run is not None else RankResult([rank])
        with contextlib.suppress(RuntimeError):  # the store may be gone with the launcher
            store.set(f"pipeoptim/result/{rank}", partial.to_json())
        raise


def _gather(store: Store, world: int, wait: float) -> list[RankResult]:
    keys = [f"pipeoptim/result/{r}" for r in range(world)]
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(store.check([k]) for k in keys):
        time.sleep(0.05)
    return [RankResult.from_json(store.get(k)) for k in keys if store.check([k])]


def _train_torchrun(config: TrainConfig) -> TrainResult | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _connect(config, rank, world, None)
    store = dist.distributed_c10d._get_default_store()
    try:
        _run_rank(config, rank, store, device)
        dist.barrier()
    except BaseException:
        if rank == 0:
            _write_trace(config, _gather(store, world, 5.0))
        raise
    results = _gather(store, world, config.timeout) if rank == 0 else []
    dist.destroy_process_group()
    if rank != 0:
        return None
    merged = _merge(config, results, f"{device.type} x{world}")
    if config.trace:
        merged.trace.save(config.trace)
    return merged


# -- the launcher -----------------------------------------------------------------------------
def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _spawn(config: TrainConfig) -> TrainResult:
    """Start one process per stage on this machine and watch them."""
    preflight(config)
    p = config.plan.num_stages
    timeout = timedelta(seconds=config.timeout)
    # Port 0: the OS picks a free port as the store binds it, so no other process can race us.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    port = store.port
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PIPEOPTIM_STORE_PORT": str(port),
        "WORLD_SIZE": str(p),
        "PIPEOPTIM_CONFIG": config.to_json(),
    }
    command = [sys.executable, "-m", "pipeoptim.runtime.launch"]
    procs = [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(p)
    ]
    try:
        codes, stopped = _watch(procs, FailureBoard(store), grace=min(10.0, config.timeout))
    except BaseException:  # e.g. Ctrl-C: take the children down with us
        for proc in procs:
            proc.kill()
        raise
    results = _gather(store, p, 0.0)
    _write_trace(config, results)
    if any(codes):
        raise _failure(FailureBoard(store), codes, stopped)
    device = "cuda" if torch.cuda.is_available() and config.device != "cpu" else "cpu"
    return _merge(config, results, f"{device} x{p}")


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


def _worker_main() -> int:
    """A spawned child: one rank, connected to the store its launcher hosts."""
    config = TrainConfig.from_json(os.environ["PIPEOPTIM_CONFIG"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores; torchrun sets it to 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    port = int(os.environ["PIPEOPTIM_STORE_PORT"])
    timeout = timedelta(seconds=config.timeout)
    store = TCPStore(os.environ["MASTER_ADDR"], port, is_master=False, timeout=timeout)
    code = 0
    try:
        device = _connect(config, rank, world, store)
        _run_rank(config, rank, store, device)
        dist.barrier()  # nobody leaves while a peer may still be reading from it
    except PipeoptimError as err:
        print(f"pipeoptim train: rank {rank}: {err}", file=sys.stderr)
        code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    # os._exit: a failed rank must not block in process-group teardown on dead peers.
    os._exit(_worker_main())
