"""A candidate of the plan search: one (method, micro-batch count) with its partition, its
predicted throughput and its convergence risk; and the method names resolved, once, into
the method objects the search passes down."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeoptim.plan.limits import max_actions
from pipeoptim.plan.methods import RANKED_BY_DEFAULT, Method, get_method
from pipeoptim.plan.partition_cost import Partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.recompute import RecomputeEntry
from pipeoptim.plan.risk import MethodRisk


def resolve_method(method: str | Method) -> Method:
    """The method object of a name a user typed (a method object passes as it is): the one
    place the search looks a method up by name."""
    return method if isinstance(method, Method) else get_method(method)


def resolve_methods(methods: Sequence[str | Method] | None) -> list[Method]:
    """The method objects of ``methods`` (default :data:`RANKED_BY_DEFAULT`), in order."""
    return [resolve_method(m) for m in (RANKED_BY_DEFAULT if methods is None else methods)]


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
    """Pipeline ranks P (devices of a replica); each holds ``virtual_stages`` stages."""
    virtual_stages: int = 1
    """Stages per rank (the method's v: 2 for zb-v and dualpipev); the partition has
    ``stages x virtual_stages`` stages."""
    rank_peak_memory_bytes: int = 0
    """Where a rank holds several stages: the fullest rank's peak, its stages together,
    from the simulated run (0: one stage per rank, the partition's stage peak)."""
    stage_ranks: tuple[int, ...] = ()
    """Where a rank holds several stages: the rank of every stage, as the method places
    them (empty: stage k on rank k)."""
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
        """The fullest device's peak: its stage's, or its stages' together."""
        if self.rank_peak_memory_bytes:
            return self.rank_peak_memory_bytes
        return self.partition.peak_memory_bytes if self.partition else 0

    @property
    def effective_throughput(self) -> float:
        """Samples per second that count toward accuracy: throughput / (1 + risk)."""
        return self.throughput / (1.0 + (self.risk.risk if self.risk else 0.0))

    @property
    def uncorrected(self) -> float:
        return self.risk.uncorrected if self.risk else 0.0


def micro_batch_options(
    method: str | Method, num_stages: int, batch_size: int | None = None
) -> list[int]:
    """M values worth trying: 1 for methods that don't micro-batch; for a method whose M
    is a dial (its default below P: PipeOptim, whose delay falls as M grows) 1, 2, 4, …
    up to P and P itself, those dividing ``batch_size`` where one is given; else P, 2P,
    4P; with a ``batch_size``, only counts that divide it (the runtime splits a batch
    evenly): those of P, 2P, 4P, else the three smallest divisors from P on (none when the
    batch has fewer samples than P)."""
    spec = resolve_method(method)
    if spec.runs_whole_mini_batches:
        return [1]
    if spec.dials_micro_batches and spec.default_micro_batches_at(num_stages) < num_stages:
        dial = sorted({1 << i for i in range(num_stages.bit_length()) if 1 << i <= num_stages})
        dial += [num_stages] if num_stages not in dial else []
        return [m for m in dial if batch_size is None or batch_size % m == 0]
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
                saved_bytes=(
                    None if layer.saved_bytes is None else -(-layer.saved_bytes * batch // (pb * m))
                ),
            )
        )
    return replace(profile, layers=tuple(layers), batch_size=max(1, batch // m))


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
