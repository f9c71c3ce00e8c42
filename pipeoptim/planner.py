"""Plan search: which method, micro-batch count and partition to run, and why.

It sits above both ``pipeoptim.plan`` (partitions, schedules, the risk term) and
``pipeoptim.sim`` (the fast evaluator that times each candidate), so neither of those
packages imports the other's way up.

For a profile, a device count and a memory cap, every candidate (method, M) gets its
optimal memory-feasible partition (``partition.py``) and is timed by the simulator's fast
evaluator over a run of mini-batches. Candidates are ranked by *effective* throughput,
``throughput / (1 + risk)``, where ``risk`` is the convergence-risk term of ``risk.py``: the
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
and throughput counts all replicas; :mod:`pipeoptim.device_search` searches the P x D
factorisations of a device count.

When the memory cap binds (no partition fits as it is), the candidate tries, in order:
sharding the optimizer state over the D replicas (ZeRO-1, only where D >= 2: the cheapest,
one weight all-gather per update), then recomputing the stages that hold the most
activations under the method (in 1F1B the early ones: stage k holds min(P - k, M)
micro-batches), one more stage at a time (sharded too where D >= 2), until a partition
fits; within each recomputed stage it then keeps only the units needed to fit, those that
free the most first. The candidate records the choice and the throughput of the same
partition without it (which would not fit), so the cost is stated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipeoptim.errors import PlanError, WorkLimitError
from pipeoptim.plan.limits import estimate_work, fit_budget, max_actions
from pipeoptim.plan.memory_factors import (
    method_holds_weights,
    method_memory_factors,
    resolve_factors,
)
from pipeoptim.plan.methods import METHODS, RANKED_BY_DEFAULT, get_method
from pipeoptim.plan.partition import min_memory_partition, optimal_partition
from pipeoptim.plan.partition_cost import Partition, evaluate_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.recompute import RecomputeEntry
from pipeoptim.plan.recompute_costs import profile_unit_costs
from pipeoptim.plan.replicas import check_batch_split, check_replicas
from pipeoptim.plan.risk import MethodRisk, method_risk
from pipeoptim.plan.units import format_bytes, format_distances
from pipeoptim.sim.collectives import Cluster, edge_links, group_within_node
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import Evaluation, compile_method, evaluate_program
from pipeoptim.sim.host import ProfiledHost, on_profiled_host


@dataclass(frozen=True)
class Candidate:
    """One evaluated (method, micro-batch count) with its partition."""

    method: str
    micro_batches: int
    partition: Partition | None
    """None when no partition fits the memory cap (see ``infeasible``)."""
    throughput: float = 0.0
    """Predicted steady-state samples per second."""
    run_throughput: float = 0.0
    """Predicted whole-run samples per second (warm-up and drain included)."""
    bubble_ratio: float = 0.0
    """Idle fraction of all ranks over the simulated run."""
    max_staleness: int = 0
    """Largest weight staleness of an applied gradient (0: fresh weights)."""
    risk: MethodRisk | None = None
    """Prediction distance and staleness per stage, uncorrected distance, convergence risk."""
    infeasible: str | None = None
    """Why the candidate cannot run (memory cap) or was not simulated (work limit), or None."""
    skipped: bool = False
    """Not simulated: the search's candidates together were over the work limit
    (:data:`pipeoptim.plan.limits.MAX_ACTIONS`); ``infeasible`` says why."""
    data_parallel: int = 1
    """Replicas D of the pipeline; ``throughput`` counts all of them."""
    allreduce_s: tuple[float, ...] = ()
    """Seconds of each stage's gradient all-reduce per update (empty: no replicas)."""
    stages: int = 0
    """Pipeline stages P (one per device of a replica)."""
    update_period_s: float = 0.0
    """Predicted steady-state seconds per mini-batch (update): global batch / throughput."""
    steady_bubble: float = 0.0
    """Idle fraction of the ranks in the steady state: 1 - mean stage busy time (all-reduce
    included) per mini-batch / ``update_period_s`` (``bubble_ratio`` counts warm-up too)."""
    recompute: tuple[frozenset[int], ...] = ()
    """Per stage the stage-local units it recomputes to fit the cap (empty: none)."""
    shard_optimizer: bool = False
    """Whether the optimizer state is sharded over the replicas to fit the cap."""
    unfitted_throughput: float = 0.0
    """Where recomputation or sharding was chosen: the steady-state throughput of the same
    partition without them (which would not fit the cap)."""
    unfitted_memory_bytes: int = 0
    """Where recomputation or sharding was chosen: the peak stage memory without them."""

    @property
    def fitted(self) -> bool:
        """Whether recomputation or sharding was chosen to fit the memory cap."""
        return any(self.recompute) or self.shard_optimizer

    @property
    def slowdown(self) -> float:
        """Throughput lost to the memory savings: 1 - throughput / unfitted throughput."""
        if not self.fitted or self.unfitted_throughput <= 0:
            return 0.0
        return 1.0 - self.throughput / self.unfitted_throughput

    def recompute_entries(self) -> list[RecomputeEntry] | None:
        """The plan file's ``recompute``: per stage none, full or its units' global
        indices (None: nothing recomputed)."""
        if not any(self.recompute) or self.partition is None:
            return None
        out: list[RecomputeEntry] = []
        for units, (start, end) in zip(self.recompute, self.partition.boundaries, strict=True):
            if not units:
                out.append("none")
            elif len(units) == end - start:
                out.append("full")
            else:
                out.append([str(start + i) for i in sorted(units)])
        return out

    @property
    def peak_memory_bytes(self) -> int:
        return self.partition.peak_memory_bytes if self.partition else 0

    @property
    def effective_throughput(self) -> float:
        """Samples per second that count toward accuracy: throughput / (1 + risk)."""
        return self.throughput / (1.0 + (self.risk.risk if self.risk else 0.0))

    @property
    def uncorrected(self) -> float:
        return self.risk.uncorrected if self.risk else 0.0


def micro_batch_options(method: str, num_stages: int, batch_size: int | None = None) -> list[int]:
    """M values worth trying: 1 for methods that don't micro-batch, else P, 2P, 4P; with a
    ``batch_size``, only counts that divide it (the runtime splits a batch evenly): those
    of P, 2P, 4P, else the three smallest divisors from P on (none when the batch has
    fewer samples than P)."""
    spec = get_method(method)
    if spec.runs_whole_mini_batches:
        return [1]
    wanted = [num_stages, 2 * num_stages, 4 * num_stages]
    if batch_size is None or num_stages < 1:  # Method.shape says what is wrong with P
        return wanted
    dividing = [m for m in wanted if batch_size % m == 0]
    if dividing:
        return dividing
    return [m for m in range(num_stages, batch_size + 1) if batch_size % m == 0][:3]


def per_unit_profile(
    profile: Profile, micro_batches: int, batch_size: int | None = None
) -> Profile:
    """The profile of one pipeline unit: a micro-batch of ``batch_size / micro_batches``
    samples (``batch_size``: one replica's mini-batch, default the profile's)."""
    pb = profile.batch_size
    batch = pb if batch_size is None else batch_size
    m = micro_batches
    if m == 1 and batch == pb:
        return profile
    samples = batch / m
    layers = []
    for layer in profile.layers:  # the fixed part of a time does not shrink with the batch
        forward, backward = layer.time_at(samples, pb)
        layers.append(
            replace(
                layer,
                forward_s=forward,
                backward_s=backward,
                activation_bytes=-(-layer.activation_bytes * batch // (pb * m)),
            )
        )
    return replace(profile, layers=tuple(layers), batch_size=max(1, batch // m))


def _sync(
    replicas: int, cluster: Cluster, num_stages: int, micro_batches: int, shard: bool = False
) -> list[tuple[float, float]] | None:
    """Each stage's all-reduce (and, with ``shard``, its weight all-gather) as the
    partitioner charges it, shared among the update's units: ``(seconds per gradient
    byte, fixed seconds)``, from the ring closed forms."""
    if replicas == 1:
        return None
    d, m = replicas, micro_batches
    rounds = 3 if shard else 2  # an all-reduce moves 2 (D-1)/D of the bytes, a gather 1
    out = []
    for k in range(num_stages):
        bw, lat = cluster.tier(group_within_node(k, num_stages, d, cluster))
        per_byte = 0.0 if math.isinf(bw) else rounds * (d - 1) / d / bw
        out.append((per_byte / m, rounds * (d - 1) * lat / m))
    return out


@dataclass(frozen=True)
class _Fit:
    partition: Partition
    shard: bool


def _fit_memory(
    unit_profile: Profile,
    method: str,
    num_stages: int,
    micro_batches: int,
    replicas: int,
    cap: int,
    cluster: Cluster,
    edges: Sequence[tuple[float, float]] | None,
) -> _Fit | None:
    """The first of sharding, then recomputing more and more stages (module doc) whose
    partition fits ``cap``, with each recomputed stage cut down to the units it needs."""
    p, d, m = num_stages, replicas, micro_batches
    factors = method_memory_factors(method, p, m)
    _, slots = resolve_factors(factors, p)
    hold = method_holds_weights(method, p)
    order = sorted(range(p), key=lambda k: (-slots[k], k))  # who holds the most first
    attempts: list[tuple[bool, int]] = [(True, 0)] if d > 1 else []
    attempts += [(d > 1, j) for j in range(1, p + 1)]
    for shard, count in attempts:
        flags = [k in order[:count] for k in range(p)]
        try:
            found = optimal_partition(
                unit_profile,
                p,
                bandwidth_bytes_per_s=cluster.bandwidth,
                latency_s=cluster.latency_s,
                memory_cap_bytes=cap,
                memory_factors=factors,
                edges=edges,
                sync=_sync(d, cluster, p, m, shard),
                recompute_stages=flags if count else None,
                hold_weights=hold,
                optimizer_shards=d if shard else 1,
            )
        except PlanError as err:
            if isinstance(err, WorkLimitError) or "memory" not in str(err):
                raise
            continue
        sets = _fewest_units(unit_profile, found, cap, slots, hold) if count else None
        partition = evaluate_partition(
            unit_profile,
            found.boundaries,
            bandwidth_bytes_per_s=cluster.bandwidth,
            latency_s=cluster.latency_s,
            memory_factors=factors,
            edges=edges,
            sync=_sync(d, cluster, p, m, shard),
            recompute=sets,
            hold_weights=hold,
            optimizer_shards=d if shard else 1,
        )
        return _Fit(partition, shard)
    return None


def _fewest_units(
    unit_profile: Profile, found: Partition, cap: int, slots: list[int], hold: list[bool]
) -> list[frozenset[int]]:
    """Per recomputed stage of ``found`` the fewest units that bring it under ``cap``: its
    memory falls by ``slots·(a_l - x_l) - [hold]·slots·w_l`` per recomputed unit ``l``
    (``partition_cost``'s doc), so the units that free the most go first."""
    units = profile_unit_costs(unit_profile)
    out: list[frozenset[int]] = []
    for k, chosen in enumerate(found.recompute or [frozenset()] * found.num_stages):
        if not chosen:
            out.append(frozenset())
            continue
        start = found.boundaries[k][0]
        # the stage's memory without recomputation: the recomputed figure plus what it freed
        frees = {
            i: slots[k] * (units.activation_bytes[start + i] - units.input_bytes[start + i])
            - (slots[k] * units.param_bytes[start + i] if hold[k] else 0)
            for i in chosen
        }
        memory = found.stage_memory[k] + sum(frees.values())
        picked: set[int] = set()
        for i in sorted(frees, key=lambda i: (-frees[i], units.forward_s[start + i], i)):
            if memory <= cap or frees[i] <= 0:
                break
            picked.add(i)
            memory -= frees[i]
        out.append(frozenset(picked) if memory <= cap else frozenset(chosen))
    return out


def _smallest_reach(
    unit_profile: Profile, method: str, num_stages: int, micro_batches: int, replicas: int
) -> int:
    """The smallest peak stage memory any partition reaches with every saving available."""
    factors = method_memory_factors(method, num_stages, micro_batches)
    hold = method_holds_weights(method, num_stages)
    shards = replicas if replicas > 1 else 1
    return min(
        min_memory_partition(
            unit_profile,
            num_stages,
            memory_factors=factors,
            recompute_stages=[full] * num_stages,
            hold_weights=hold,
            optimizer_shards=shards,
        ).peak_memory_bytes
        for full in (False, True)
    )


def evaluate_candidate(
    profile: Profile,
    num_stages: int,
    method: str,
    micro_batches: int,
    *,
    memory_cap_bytes: int | None = None,
    bandwidth_bytes_per_s: float = math.inf,
    latency_s: float = 0.0,
    mini_batches: int | None = None,
    optimizer: str = "sgd",
    replicas: int = 1,
    cluster: Cluster | None = None,
    batch_size: int | None = None,
    short_run: bool = False,
) -> Candidate:
    """Partition for ``method`` at ``micro_batches`` and simulate it; ``optimizer`` sets
    the convergence-risk coefficient (``risk.py``).

    ``batch_size`` is the global mini-batch (default: the profile's), shared by
    ``replicas`` replicas placed on ``cluster``; a cluster replaces
    ``bandwidth_bytes_per_s`` and ``latency_s`` (its within-node tier is the one link
    without ``gpus_per_node``). ``short_run``: ``mini_batches`` is short of the settled
    steady state, so the throughput is capped at what the busiest stage allows (what a
    long run converges to), not what `simulate` shows at its default run length."""
    spec = get_method(method)
    shape = spec.shape(num_stages, spec.micro_batches_for(micro_batches), mini_batches)
    if spec.places_several_stages_per_rank:
        raise PlanError(
            f"plan search places one stage per device; {method} (several stages per "
            f"device) is not searched — pick it by hand with `pipeoptim simulate`"
        )
    d, m = check_replicas(replicas, "replicas"), shape.micro_batches
    batch = profile.batch_size if batch_size is None else batch_size
    if d > 1:  # (one replica keeps its old leniency: M need not divide the batch)
        check_batch_split(batch, d, m)
    if cluster is None:
        cluster = Cluster(bandwidth_bytes_per_s, latency_s)
    links = (
        edge_links(num_stages, d, cluster) if d > 1 or cluster.gpus_per_node is not None else None
    )
    unit_profile = per_unit_profile(profile, m, batch // d)
    fit: _Fit | None = None
    try:
        partition = optimal_partition(
            unit_profile,
            num_stages,
            bandwidth_bytes_per_s=cluster.bandwidth,
            latency_s=cluster.latency_s,
            memory_cap_bytes=memory_cap_bytes,
            memory_factors=method_memory_factors(method, num_stages, m),
            edges=links,
            sync=_sync(d, cluster, num_stages, m),
        )
    except PlanError as err:
        if isinstance(err, WorkLimitError) or "memory" not in str(err):
            raise
        assert memory_cap_bytes is not None
        cap = int(memory_cap_bytes)
        fit = _fit_memory(unit_profile, method, num_stages, m, d, cap, cluster, links)
        if fit is None:
            reach = _smallest_reach(unit_profile, method, num_stages, m, d)
            sharding = f" and sharding the optimizer state over {d} replicas" if d > 1 else ""
            size = format_bytes(reach, round_up=True)
            why = (
                f"no partition of {profile.num_layers} layers into {num_stages} stages fits "
                f"the memory cap of {format_bytes(cap)} ({cap} bytes) per device, even "
                f"recomputing activations{sharding}; the smallest possible peak is "
                f"{size} ({reach} bytes); raise --memory-cap to at least {size} or use "
                f"more stages"
            )
            return Candidate(method, m, None, infeasible=why, data_parallel=d, stages=num_stages)
        partition = fit.partition

    host = ProfiledHost.of(profile)  # the machine and runtime costs it was measured with

    def stage_costs(recompute: list[frozenset[int]] | None = None) -> CostModel:
        costs = CostModel.from_profile(
            profile,
            partition.boundaries,
            m,
            batch_size=batch // d,
            bandwidth=cluster.bandwidth,
            latency_s=cluster.latency_s,
            recompute=recompute,
        )
        costs = on_profiled_host(costs, host, spec, num_stages, data_parallel=d)
        return costs.with_data_parallel(d, cluster) if links is not None else costs

    costs = stage_costs()
    # one compiled order (cached per method and shape) serves timing and versions
    program = compile_method(method, shape)
    unfitted = 0.0
    unfitted_memory = 0
    if fit is not None:  # the same partition without the savings: what they cost
        unfitted = _steady(evaluate_program(program, costs), short_run)
        unfitted_memory = evaluate_partition(
            unit_profile,
            partition.boundaries,
            memory_factors=method_memory_factors(method, num_stages, m),
        ).peak_memory_bytes
        costs = stage_costs(list(partition.recompute) if partition.recomputes else None)
        if fit.shard:
            costs = costs.with_sharded_optimizer(cluster)
    result = evaluate_program(program, costs)
    report = program.versions()
    stages = range(num_stages * shape.virtual_stages)
    risk = method_risk(
        method,
        optimizer,
        [report.max_distance(k) for k in stages],
        [report.max_staleness(k) for k in stages],
    )
    steady = _steady(result, short_run)
    return Candidate(
        method,
        m,
        partition,
        throughput=steady,
        run_throughput=result.throughput,
        bubble_ratio=result.overall_bubble,
        max_staleness=max(report.max_staleness(k) for k in report.stages),
        risk=risk,
        data_parallel=d,
        allreduce_s=costs.allreduce_s if d > 1 else (),
        stages=num_stages,
        update_period_s=batch / steady if steady > 0 else 0.0,
        steady_bubble=_steady_bubble(result.busy_s, result.samples, steady),
        recompute=partition.recompute,
        shard_optimizer=fit is not None and fit.shard,
        unfitted_throughput=unfitted,
        unfitted_memory_bytes=unfitted_memory,
    )


def _steady(result: Evaluation, short_run: bool) -> float:
    steady = result.steady_throughput
    if short_run and result.busy_s:
        # A short run's last updates can still be faster than the run settles to: an
        # async pipeline drains its in-flight slack before a slightly slower stage sets
        # the pace. No stage trains faster than its own busy time allows: that caps it.
        steady = min(steady, result.samples / max(result.busy_s.values()))
    return steady


def memory_choice(c: Candidate, memory_cap_bytes: int | None) -> str | None:
    """What the candidate does to fit the cap and what it costs, in one sentence (None:
    nothing)."""
    if not c.fitted or c.partition is None:
        return None
    parts = []
    entries = c.recompute_entries() or []
    stages = [k for k, e in enumerate(entries) if e != "none"]
    if stages:
        what = "; ".join(
            f"stage {k} "
            + ("all its units" if entries[k] == "full" else "units " + ",".join(entries[k]))
            for k in stages
        )
        parts.append(f"recompute activations ({what})")
    if c.shard_optimizer:
        parts.append(f"shard the optimizer state over the {c.data_parallel} replicas (ZeRO-1)")
    cap = f"the {format_bytes(memory_cap_bytes)} cap" if memory_cap_bytes else "the cap"
    return (
        f"Memory: no partition fits {cap} as it is, so {' and '.join(parts)}; peak stage "
        f"memory {format_bytes(c.peak_memory_bytes)} instead of "
        f"{format_bytes(c.unfitted_memory_bytes)}, at {100 * c.slowdown:.1f}% less "
        f"throughput ({format_rate(c.throughput)} against {format_rate(c.unfitted_throughput)} "
        f"samples/s for the same partition without it, which would not fit)."
    )


def _steady_bubble(busy_s: dict[int, float], samples: float, rate: float) -> float:
    """1 - mean busy seconds / run length at ``rate`` (its steady state)."""
    if not busy_s or samples <= 0 or rate <= 0:
        return 0.0
    mean = math.fsum(busy_s.values()) / len(busy_s)
    return min(1.0, max(0.0, 1.0 - mean * rate / samples))


def search(
    profile: Profile,
    num_stages: int,
    *,
    memory_cap_bytes: int | None = None,
    bandwidth_bytes_per_s: float = math.inf,
    latency_s: float = 0.0,
    methods: Sequence[str] | None = None,
    mini_batches: int | None = None,
    tie_tolerance: float = 0.01,
    progress: Callable[[str], None] | None = None,
    optimizer: str = "sgd",
    cluster: Cluster | None = None,
    batch_size: int | None = None,
) -> list[Candidate]:
    """Every feasible candidate ranked best first, then the infeasible ones; ``cluster``
       and ``batch_size`` (the mini-batch, default the profile's) as in
       :func:`evaluate_candidate`.
    ``methods`` defaults to :data:`~pipeoptim.plan.methods.RANKED_BY_DEFAULT`."""
    names = list(methods) if methods is not None else list(RANKED_BY_DEFAULT)
    if num_stages > profile.num_layers:
        raise PlanError(
            f"cannot split {profile.num_layers} layers into {num_stages} stages; use at "
            f"most {profile.num_layers} stages"
        )
    pairs = [
        (name, m)
        for name in names
        for m in micro_batch_options(name, num_stages, batch_size or profile.batch_size)
    ]
    sizes = [_actions(name, num_stages, m, mini_batches) for name, m in pairs]
    keep = fit_budget(sizes)
    found: list[Candidate] = []
    simulated: dict[tuple[str, int], Candidate] = {}
    for (name, m), size, kept in zip(pairs, sizes, keep, strict=True):
        if not kept:
            found.append(skipped_candidate(name, m, size, num_stages))
            continue
        twin = simulated.get((get_method(name).schedule_family, m))
        if twin is not None:  # a corrected method: its base's timeline, its own risk
            found.append(_corrected_candidate(twin, name, optimizer))
            continue
        if progress is not None:
            progress(f"{name} M={m}")
        found.append(
            evaluate_candidate(
                profile,
                num_stages,
                name,
                m,
                memory_cap_bytes=memory_cap_bytes,
                bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                latency_s=latency_s,
                mini_batches=mini_batches,
                optimizer=optimizer,
                cluster=cluster,
                batch_size=batch_size,
            )
        )
        simulated[(name, m)] = found[-1]
    return rank(found, tie_tolerance)


def _corrected_candidate(base: Candidate, method: str, optimizer: str) -> Candidate:
    """``method`` keeps ``base``'s schedule, versions and memory (a delay correction or a
    prediction's distance): the same simulated run, its own convergence risk."""
    if base.risk is None:
        return replace(base, method=method)
    risk = method_risk(method, optimizer, base.risk.distances, base.risk.staleness)
    return replace(base, method=method, risk=risk)


def _actions(method: str, num_stages: int, micro_batches: int, mini_batches: int | None) -> int:
    """Simulated actions of one candidate (0 where the method's rules refuse the sizes:
    evaluating it raises the rule's own message)."""
    spec = get_method(method)
    try:
        shape = spec.shape(num_stages, spec.micro_batches_for(micro_batches), mini_batches)
    except PlanError:
        return 0
    return estimate_work(spec, shape).cost


def skipped_candidate(
    method: str, micro_batches: int, size: int, num_stages: int, replicas: int = 1
) -> Candidate:
    limit = max_actions()
    why = (
        f"not simulated: about {size:,} actions, over the limit of {limit:,}"
        if size > limit
        else f"not simulated: about {size:,} actions, and with the other candidates the search "
        f"is over its limit of {limit:,} actions; plan it alone with --method {method} "
        f"--micro-batches {micro_batches}"
    )
    return Candidate(
        method,
        micro_batches,
        None,
        infeasible=why,
        skipped=True,
        data_parallel=replicas,
        stages=num_stages,
    )


def rank(candidates: Sequence[Candidate], tie_tolerance: float = 0.01) -> list[Candidate]:
    """Highest effective throughput first; near-ties (within ``tie_tolerance``) by
    uncorrected distance, staleness, memory, then throughput; an exact tie last by the
    prediction rule: the optimizer's own update rule (PipeOptim's) before a fixed one, since
    two rules that predict alike for this optimizer (SpecTrain's momentum is SGD's Δ) part
    ways for another (under Adam SpecTrain's removes about none of the stale distance)."""
    feasible = [c for c in candidates if c.infeasible is None]
    best = max((c.effective_throughput for c in feasible), default=0.0)

    def key(c: Candidate) -> tuple[int, float, int, int, float, int]:
        # bucket throughput on a log scale so near-equal values compare equal
        rate = c.effective_throughput
        gap = math.log(best / rate) if rate > 0 and best > 0 else math.inf
        bucket = int(gap / math.log1p(tie_tolerance)) if math.isfinite(gap) else 2**31
        method = METHODS.get(c.method)
        general = 0 if method is not None and method.predictor == "optimizer" else 1
        return (
            bucket,
            c.uncorrected,
            c.max_staleness,
            c.peak_memory_bytes,
            -c.throughput,
            general,
        )

    return sorted(feasible, key=key) + [c for c in candidates if c.infeasible is not None]


def format_rate(samples_per_s: float) -> str:
    """Samples per second for a sentence: whole numbers from 100 on, else 3 digits."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def explain(ranked: Sequence[Candidate], memory_cap_bytes: int | None = None) -> str:
    """One paragraph: what to run and why, against the runner-up and the baselines."""
    feasible = [c for c in ranked if c.infeasible is None]
    if not feasible:
        first = ranked[0].infeasible if ranked else "no candidates"
        raise PlanError(f"no method fits: {first}")
    best = feasible[0]
    cap = f" within the {format_bytes(memory_cap_bytes)} cap" if memory_cap_bytes else ""
    text = (
        f"Run {best.method} with {best.micro_batches} micro-batch(es): predicted "
        f"{format_rate(best.throughput)} samples/s, {describe_staleness(best)}, peak stage "
        f"memory {format_bytes(best.peak_memory_bytes)}{cap}."
    )
    choice = memory_choice(best, memory_cap_bytes)
    if choice:
        text += " " + choice
    # as fast or faster per sample, ranked lower only because of the convergence risk
    passed = [
        c
        for c in feasible[1:]
        if c.method != best.method
        and c.throughput >= best.throughput * 0.99
        and c.effective_throughput < best.effective_throughput * 0.99
    ]
    if passed:
        text += " " + _passed_over(passed, best)
    slower = [c for c in feasible[1:] if c.method != best.method and c not in passed]
    if slower:
        other = slower[0]
        ratio = best.throughput / other.throughput if other.throughput > 0 else math.inf
        if ratio > 1.001:
            pace = f"{ratio:.3g}x slower"
        elif ratio < 0.999:  # faster per sample, level once its convergence risk counts
            pace = f"{1 / ratio:.3g}x faster per sample, level after its convergence risk"
        else:
            pace = "as fast"
        text += (
            f" Next best: {other.method} (M={other.micro_batches}), "
            f"{format_rate(other.throughput)} samples/s ({pace}), {describe_staleness(other)}, "
            f"peak memory {format_bytes(other.peak_memory_bytes)}."
        )
    fits = {c.method for c in feasible}
    out = sorted({c.method for c in ranked if c.infeasible is not None and not c.skipped} - fits)
    if out:
        text += f" Over the memory cap: {', '.join(out)}."
    skipped = [f"{c.method} M={c.micro_batches}" for c in ranked if c.skipped]
    if skipped:
        text += (
            f" Not simulated (over the work limit, pipeoptim.plan.limits): {', '.join(skipped)}."
        )
    return text


def describe_staleness(c: Candidate) -> str:
    """Staleness and prediction distance together: staleness 0 with s = 7 is not fresh."""
    if c.risk is None or not any(c.risk.distances):
        return f"weight staleness {c.max_staleness}"
    r = c.risk
    text = (
        f"weight staleness {c.max_staleness}, prediction distance s {format_distances(r.distances)}"
    )
    if r.closed is not None:
        text += (
            f" (its prediction removes about {100 * r.closed:.0f}% of the stale distance at "
            f"s = {max(r.distances)})"
        )
    return text + f", convergence risk +{100 * r.risk:.0f}% samples"


def _passed_over(passed: Sequence[Candidate], best: Candidate) -> str:
    """Why candidates as fast or faster per sample are not the recommendation: the risk of
    each method (its best-ranked candidate), with what drives it."""
    first: dict[str, Candidate] = {}
    for c in passed:
        first.setdefault(c.method, c)
    ratio = max(c.throughput for c in passed) / best.throughput
    pace = f"up to {ratio:.3g}x faster" if ratio > 1.01 else "as fast"
    names = list(first)
    who = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"
    verb = "is" if len(names) == 1 else "are"
    reasons = [_risk_reason(c) for c in first.values()]
    kappa = next((c.risk.kappa for c in first.values() if c.risk is not None), None)
    closest = max(passed, key=lambda c: c.effective_throughput)
    scale = f"κ = {kappa:.3g} per update of uncorrected distance, " if kappa is not None else ""
    return (
        f"{who} {verb} {pace} per sample but not chosen because of the convergence risk "
        f"({scale}fitted by the convergence study; pipeoptim.plan.risk): "
        + "; ".join(reasons)
        + f". So the time to accuracy is longer ({format_rate(closest.effective_throughput)} "
        f"against {format_rate(best.effective_throughput)} effective samples/s at best)."
    )


def _risk_reason(c: Candidate) -> str:
    r = c.risk
    if r is None:
        return f"{c.method} ranks lower"
    if r.closed is not None and any(r.distances):
        s = max(r.distances)
        return (
            f"{c.method} +{100 * r.risk:.0f}% samples (its forward predicts s = {s} updates "
            f"ahead and the prediction removes only about {100 * r.closed:.0f}% of that stale "
            f"distance: e = {r.uncorrected:.2g})"
        )
    return f"{c.method} +{100 * r.risk:.0f}% samples (staleness {max(r.staleness, default=0)})"


def memory_notes(c: Candidate) -> dict[str, object]:
    """A plan's notes on what was done to fit the memory cap (empty: nothing)."""
    if not c.fitted:
        return {}
    return {
        "memory_fit": {
            "recompute": c.recompute_entries(),
            "shard_optimizer": c.shard_optimizer,
            "samples_per_s_without": c.unfitted_throughput,
            "peak_memory_bytes_without": c.unfitted_memory_bytes,
            "slowdown": c.slowdown,
        }
    }
