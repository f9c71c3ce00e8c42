"""Plan search, in one home: which method, micro-batch count, partition and P x D split to run,
and why.

It sits above both ``pipeoptim.plan`` (partitions, schedules, the risk term) and
``pipeoptim.sim`` (the fast evaluator that times each candidate), so neither of those
packages imports the other's way up.

For a profile, a device count and a memory cap, every candidate (method, M) gets its
optimal memory-feasible partition (``plan/partition.py``) and is timed by the simulator's fast
evaluator over a run of mini-batches. Candidates are ranked by *effective* throughput,
``throughput / (1 + risk)``, where ``risk`` is the convergence-risk term of ``plan/risk.py``: the
extra samples to accuracy the study measured for the method's uncorrected distance under the
optimizer. Effective throughputs within ``tie_tolerance`` of each other count as equal and
are ordered by uncorrected distance, then peak memory, so a method that is as fast and
trains on fresher weights wins.

The profile is taken as measured on one mini-batch of ``profile.batch_size`` samples; a
micro-batch costs ``1/M`` of its time and activations (the linear model the simulator uses,
keeping the profile's fitted fixed part of each time). A profile taken for a multi-rank run
on its machine (``pipeoptim profile --ranks P``) times every candidate on that machine
(:mod:`pipeoptim.sim.host`: ranks sharing its cores, the measured cost of each message and
of each action beyond its layers). With D data-parallel replicas
(``replicas``, PP x DP) each replica trains ``batch_size / D`` samples of every batch, its
links and all-reduces follow the ``cluster``'s placement (:mod:`pipeoptim.sim.collectives`),
and throughput counts all replicas; :mod:`~pipeoptim.planning.devices` searches the P x D
factorisations of a device count.

When the memory cap binds (no partition fits as it is), the candidate tries, in order:
sharding the optimizer state over the D replicas (ZeRO-1, only where D >= 2: the cheapest,
one weight all-gather per update), then recomputing the stages that hold the most
activations under the method (in 1F1B the early ones: stage k holds min(P - k, M)
micro-batches), one more stage at a time (sharded too where D >= 2), until a partition
fits; within each recomputed stage it then keeps only the units needed to fit, those that
free the most first. The candidate records the choice and the throughput of the same
partition without it (which would not fit), so the cost is stated.

The entry is :func:`~pipeoptim.planning.entry.plan_for`: it resolves the method and the
profile's host once and passes the resolved objects down. The modules, by concern:
candidate (a candidate, the method names resolved), memory_fit (fitting the cap), evaluate
(one candidate partitioned and timed), stage_search (the search for P stages and the
ranking), devices (the search over P x D), explain and explain_devices (the words), entry
(:func:`plan_for` and the one place a candidate becomes a Plan).
"""

from pipeoptim.planning.candidate import (
    Candidate,
    micro_batch_options,
    per_unit_profile,
    resolve_method,
    resolve_methods,
    skipped_candidate,
)
from pipeoptim.planning.devices import (
    DeviceSearch,
    Factorisation,
    factorisations,
    search_devices,
    steady_mini_batches,
)
from pipeoptim.planning.entry import (
    PlanChoice,
    PlanLimits,
    cluster_notes,
    plan_for,
    plan_from_candidate,
)
from pipeoptim.planning.evaluate import evaluate_candidate
from pipeoptim.planning.explain import (
    describe_staleness,
    explain,
    format_rate,
    memory_choice,
    memory_notes,
)
from pipeoptim.planning.explain_devices import Shares, explain_devices, shares
from pipeoptim.planning.stage_search import rank, search

__all__ = [
    "Candidate",
    "DeviceSearch",
    "Factorisation",
    "PlanChoice",
    "PlanLimits",
    "Shares",
    "cluster_notes",
    "describe_staleness",
    "evaluate_candidate",
    "explain",
    "explain_devices",
    "factorisations",
    "format_rate",
    "memory_choice",
    "memory_notes",
    "micro_batch_options",
    "per_unit_profile",
    "plan_for",
    "plan_from_candidate",
    "rank",
    "resolve_method",
    "resolve_methods",
    "search",
    "search_devices",
    "shares",
    "skipped_candidate",
    "steady_mini_batches",
]
