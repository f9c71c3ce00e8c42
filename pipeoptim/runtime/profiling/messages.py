"""Timing messages between two processes of this host over gloo, for the simulator.

A pipeline run on CPU moves every activation and gradient between two rank processes over
gloo, and on a small model that costs more than the layers. The simulator charges a
message a fixed work at each end (occupying the rank, so shared with the host's other
ranks when they take turns on its cores) and a latency between; :func:`time_messages`
measures what a run meets with this process and one spawned process on one gloo process
group of their own (no default group is made, so a caller under ``torch.distributed`` is
left as it was), in rounds of a ping-pong where each side computes a small torch step
(:func:`_step`, about a small stage's forward and backward) between two messages, so each
waits asleep for the other's message as a pipeline rank waits for its input, each process
on a core of its own where it may use two (else both on the one):

* the work of a message at its two ends: CPU seconds of each whole process (its gloo
  threads included) per round less its step, half a round's for each end (each side sends
  one message and takes one in per round);
* the latency: half of what a round takes beyond both sides' CPU;
* how much slower a step runs between two waits than in a loop (``burst_slowdown``): a
  rank's work comes in bursts between its messages, and after each wait its caches and its
  core are cold, which layers timed in a loop (as the profiler times them) never meet;
* the same slowdown with both processes, every thread of each, on one core
  (``shared_burst_slowdown``), as ranks that outnumber the cores take turns on them (the
  other process ran there since, so more of its caches are gone);
* what those slowdowns are in seconds (``burst_s``, ``shared_burst_s``): the step's CPU
  between waits less its CPU in a loop. That, not the ratio, is what a rank pays after a
  wait: the caches refill and the core wakes once per wait, whatever the size of the work
  that follows, so a ratio taken on this small step does not carry over to a model's
  actions (the offline model that multiplied a model's layer times by it predicted a
  2-rank run of 8 x Linear(1024) at -57 %).

Each is the median over the rounds (a round another process of the host delayed is not the
host's cost).
The tensors are small (what does not grow with a message's size is measured; its bytes are
the links' bandwidth). A few hundred rounds settle in about a second once the other
process is up; starting it (a spawned interpreter importing torch) is most of the time.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

__all__ = ["MessageTiming", "time_messages", "wait_for_result"]

_SHAPE = (16, 64)
"""The tensor sent: 4 KiB of float32, about a small model's boundary activation."""

_WARM = 200
"""Steps timed in a loop, for the speed a step has when nothing waits between them."""


@dataclass(frozen=True)
class MessageTiming:
    """What a message between two processes of this host costs (seconds, a ratio)."""

    send_s: float
    """Work of the sending process per message (posting it, gloo's write)."""
    receive_s: float
    """Work of the receiving process per message (woken from its wait, taking it in)."""
    latency_s: float
    """Time from the post to the receiver having it, beyond both ends' work."""
    burst_slowdown: float
    """CPU of a step between two waits over its CPU in a loop (at least 1), each process
    on a core of its own."""
    shared_burst_slowdown: float
    """The same with both processes (all their threads) taking turns on one core, as
    ranks that outnumber the cores do (:attr:`burst_slowdown` where that cannot be set)."""
    rounds: int
    """Ping-pong rounds each figure is over."""
    burst_s: float = 0.0
    """CPU seconds a step between two waits took beyond the same step in a loop (at least
    0), each process on a core of its own: what a wait costs the work after it."""
    shared_burst_s: float = 0.0
    """The same where both processes take turns on one core (:attr:`burst_s` where that
    cannot be set)."""


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _step() -> Callable[[], None]:
    """A small training step: two 128-wide linear layers, forward and backward, batch 16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128))
    x = torch.randn(16, 64)

    def step() -> None:
        model(x).sum().backward()

    return step


def _warm_step(step: Callable[[], None]) -> float:
    """Median thread CPU seconds of a step in a loop."""
    for _ in range(_WARM // 4):
        step()
    times = []
    for _ in range(_WARM):
        begun = time.thread_time()
        step()
        times.append(time.thread_time() - begun)
    return statistics.median(times)


def _rounds(
    group: Any, rank: int, rounds: int, step: Callable[[], None]
) -> list[tuple[float, float, float]]:
    """``rounds`` ping-pong rounds with a step on each side between the messages; returns
    (process CPU, CPU in the step, wall) of each round."""
    out, buf = torch.zeros(_SHAPE), torch.empty(_SHAPE)
    peer = 1 - rank
    group.barrier().wait()
    found = []
    for i in range(rounds):
        cpu, wall = _cpu(), time.perf_counter()
        if rank == 1:
            group.recv([buf], peer, i).wait()
        begun = time.thread_time()
        step()
        stepping = time.thread_time() - begun
        group.send([out], peer, i).wait()
        if rank == 0:
            group.recv([buf], peer, i).wait()
        found.append((_cpu() - cpu, stepping, time.perf_counter() - wall))
    return found


def _group(store: Store, rank: int, core: int | None, timeout: float) -> Any:
    """This thread on ``core`` (None: where it is) and a gloo group over ``store``: its
    threads are started from this one, so they are on that core too."""
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    return torch.distributed.ProcessGroupGloo(
        PrefixStore("messages", store), rank, 2, timedelta(seconds=timeout)
    )


def _all_threads_on(cores: set[int]) -> None:
    """Every thread of this process (gloo's too) on ``cores``."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


_Phase = tuple[float, list[tuple[float, float, float]]]
"""A phase's warm step CPU and its rounds (process CPU, step CPU, wall)."""


def _phases(
    group: Any, rank: int, rounds: int, step: Callable[[], None], shared: int | None
) -> list[_Phase]:
    """The ping-pong on cores of their own (as the group was made), then, where the
    process may move to ``shared``, with every thread of both processes on that one."""
    found: list[_Phase] = [(_warm_step(step), _rounds(group, rank, rounds, step))]
    if shared is not None:
        _all_threads_on({shared})
        found.append((_warm_step(step), _rounds(group, rank, rounds, step)))
    return found


def _partner(
    port: int, rounds: int, cores: tuple[int | None, int | None], timeout: float, results: Any
) -> None:
    """The spawned process: rank 1 of the ping-pong, on ``cores[0]``, then ``cores[1]``."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=timeout))
    step = _step()
    group = _group(store, 1, cores[0], timeout)
    results.put(_phases(group, 1, rounds, step, cores[1]))
    group.barrier().wait()


def time_messages(*, rounds: int = 200, timeout: float = 60.0) -> MessageTiming:
    """Time messages between this process and a spawned one over gloo (module docstring).
    Raises ``RuntimeError`` where a process cannot be spawned or gloo cannot connect."""
    import torch.multiprocessing as mp

    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    own = (allowed[0], allowed[1]) if len(allowed) >= 2 else (None, None)
    shared = allowed[0] if len(allowed) >= 2 and os.path.isdir("/proc/self/task") else None
    context = mp.get_context("spawn")
    master = TCPStore(
        "127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )  # fmt: skip
    results = context.SimpleQueue()
    proc = context.Process(
        target=_partner,
        args=(master.port, rounds, (own[1], shared), timeout, results),
        daemon=True,
    )
    proc.start()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        step = _step()
        group = _group(master, 0, own[0], timeout)
        mine = _phases(group, 0, rounds, step, shared)
        theirs = wait_for_result(results, [proc], timeout, ["the partner process"])
        group.barrier().wait()
    finally:
        if shared is not None:
            _all_threads_on(set(allowed))
        elif allowed:
            os.sched_setaffinity(0, set(allowed))
        torch.set_num_threads(threads)
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    a, b = mine[0][1], theirs[0][1]
    # A round: each side one step, one send and one receive, the two sides in turn.
    messaging = [(x[0] - x[1] + y[0] - y[1]) / 4 for x, y in zip(a, b, strict=True)]
    beyond = [(x[2] - x[0] - y[0]) / 2 for x, y in zip(a, b, strict=True)]
    message_s = max(0.0, statistics.median(messaging))
    own_burst, own_loop = _burst(mine[0], theirs[0])
    shared_burst, shared_loop = (
        _burst(mine[1], theirs[1]) if shared is not None else (own_burst, own_loop)
    )
    return MessageTiming(
        send_s=message_s,
        receive_s=message_s,
        latency_s=max(0.0, statistics.median(beyond)),
        burst_slowdown=_ratio(own_burst, own_loop),
        shared_burst_slowdown=_ratio(shared_burst, shared_loop),
        rounds=rounds,
        burst_s=max(0.0, own_burst - own_loop),
        shared_burst_s=max(0.0, shared_burst - shared_loop),
    )


def _burst(mine: _Phase, theirs: _Phase) -> tuple[float, float]:
    """The two sides' median step CPU between waits and in a loop (seconds)."""
    burst = statistics.median([x[1] for x in mine[1]] + [y[1] for y in theirs[1]])
    return burst, statistics.median([mine[0], theirs[0]])


def _ratio(burst: float, warm: float) -> float:
    """How many times slower the steps between waits ran (never below 1: a faster burst
    is noise)."""
    return max(1.0, burst / warm) if warm > 0 else 1.0


def wait_for_result(
    results: Any, procs: Sequence[Any], timeout: float, names: Sequence[str]
) -> Any:
    """The first item on ``results``, which ``procs[0]`` puts there; RuntimeError naming
    the process (``names``, one per process) where the first exited without putting it,
    another exited with an error, or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while results.empty():
        for i, proc in enumerate(procs):
            if not proc.is_alive() and (i == 0 or proc.exitcode != 0) and results.empty():
                raise RuntimeError(f"{names[i]} exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{names[0]} sent no result in {timeout:.0f} s")
        time.sleep(0.01)
    return results.get()
