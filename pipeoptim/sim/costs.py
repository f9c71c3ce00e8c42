"""The cost model: how long every action takes and how many bytes every stage holds and sends.

Both engines (the SimPy simulator and the fast evaluator) read one :class:`CostModel`, so
their answers differ only where the engines differ (jitter, link contention). Everything is
per *stage* and per *micro-batch* (the unit of work the pipeline moves): a method that does
not micro-batch has one micro-batch per mini-batch.

A cost model comes from

* a uniform spec (:meth:`CostModel.uniform`, ``--uniform F,B[,U]``): every stage takes F
  seconds forward and B seconds backward for one micro-batch (and U per update);
* a :class:`~pipeoptim.plan.profile.Profile` and stage boundaries
  (:meth:`CostModel.from_profile`): per-layer costs summed per stage, scaled from the
  profile's batch to one micro-batch;
* a stage graph (:meth:`CostModel.from_stage_graph`) or a :class:`~pipeoptim.plan.plan.Plan`
  (:meth:`CostModel.from_plan`).

Links: edge ``k`` joins stage ``k`` and ``k+1``. A transfer over it takes
``latency_s[k] + bytes / bandwidth[k]`` (store-and-forward: the link is busy that long), and
costs nothing when both stages sit on one rank.

Data parallelism (:meth:`CostModel.with_data_parallel`): D replicas of the pipeline, each on
its share of the batch, are timed as one replica whose updates also all-reduce the stage's
gradients (:mod:`pipeoptim.sim.collectives`); throughput counts all D.

Activation recomputation (``recompute=`` of :meth:`CostModel.from_profile` and
:meth:`CostModel.from_stage_graph`, the formula of :mod:`pipeoptim.plan.recompute_costs`):
a stage's ``activation_bytes`` become what it keeps (the recomputed units' inputs instead
of their activations), every backward (a split one's input half) runs the recomputed
units' forward again (``recompute_s``), a split backward holds the rebuilt activations
from its I to its W (``rebuilt_activation_bytes``), and under prediction every in-flight
micro-batch that ran on predicted weights holds the recomputed units' Ŵ
(``held_weight_bytes``, counted by :mod:`pipeoptim.sim.memory` as stash).

Sharded optimizer state (:meth:`CostModel.with_sharded_optimizer`, ZeRO-1): each replica
keeps ``ceil(optimizer_state_bytes / D)``, steps 1/D of the weights (``update_s / D``)
and then all-gathers them (``gather_s``, inside the update like the all-reduce).

Messages and shared cores: a message between two ranks costs the sender
``message_send_s`` (added to the action whose output it carries) and the receiver
``message_receive_s`` (added to the action that consumes it), whatever its size; the link
adds its latency and bytes in between. ``machine`` (:class:`~pipeoptim.plan.machine.Machine`)
is the host the ranks share: where their threads outnumber its cores the busy ranks share
them (:mod:`pipeoptim.sim.sharing`). ``action_s`` is the fixed work of the executor and
the stage around each action's layers, per kind (F, B, U, I, W), added to every action of
that kind. All three default to nothing, today's model of a device per rank, free messages
and actions that are their layers, to the bit. :meth:`scaled` leaves them as they are (they
are the host's, not the device's). :mod:`pipeoptim.sim.host` sets them from what a profile
measured of its host.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipeoptim.errors import PlanError
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.orders import KIND_CODES
from pipeoptim.plan.profile import optimizer_state_factor
from pipeoptim.plan.recompute import check_shard_optimizer
from pipeoptim.plan.recompute_costs import (
    UNIT_KEYS,
    UnitCosts,
    annotate_units,
    graph_unit_costs,
    labels_from_names,
    profile_unit_costs,
    stage_recompute,
    stage_unit_sets,
)
from pipeoptim.plan.replicas import check_replicas
from pipeoptim.sim.collectives import Cluster, allgather_times, allreduce_times, edge_links

if TYPE_CHECKING:
    import networkx as nx

    from pipeoptim.plan.plan import Plan
    from pipeoptim.plan.profile import Profile

__all__ = ["UNIT_KEYS", "CostModel", "annotate_units", "graph_recompute_sets", "parse_uniform"]


def _expand(name: str, values: float | Sequence[float], count: int) -> list[float]:
    """One value per stage (or edge): a single number is repeated ``count`` times."""
    raw = [values] * count if isinstance(values, (int, float)) else list(values)
    per = "edge" if name.endswith(" (per edge)") else "stage"
    base = name.removesuffix(" (per edge)")
    if len(raw) != count:
        raise PlanError(
            f"{base} needs one value per {per} (got {len(raw)} values for {count}); pass one "
            f"number or a list of {count}"
        )
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            where = f"link {i} (between stages {i} and {i + 1})" if per == "edge" else f"stage {i}"
            raise PlanError(
                f"the {base} of {where} must be a number >= 0 (got {v!r}); give a value >= 0"
            )
    return raw


def _floats(name: str, values: float | Sequence[float], count: int) -> tuple[float, ...]:
    return tuple(float(v) for v in _expand(name, values, count))


def _fractions(values: object, count: int) -> tuple[float, ...]:
    """The per-stage weight-gradient shares: one number in [0, 1], or one per stage."""
    rule = "the share of a backward that computes the weight gradient"
    fix = "e.g. 0.5 (the zero-bubble paper's T_I = T_W), or re-profile"
    if not isinstance(values, (int, float)) and not (
        isinstance(values, Sequence) and not isinstance(values, str)
    ):
        raise PlanError(
            f"weight_grad_fraction must be a number in [0, 1] ({rule}) or one such number "
            f"per stage (got {values!r}); give {fix}"
        )
    raw = [values] * count if isinstance(values, (int, float)) else list(values)
    if len(raw) != count:
        raise PlanError(
            f"weight_grad_fraction needs one value per stage (got {len(raw)} values "
            f"{raw!r} for {count} stages); pass one number or a list of {count}"
        )
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise PlanError(
                f"the weight_grad_fraction of stage {i} must be a number in [0, 1], {rule} "
                f"(got {v!r}); give {fix}"
            )
    return tuple(float(v) for v in raw)


def _seconds(value: object) -> float | None:
    """``value`` as seconds where it is a finite number >= 0 (a bool is not), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def _ints(name: str, values: int | Sequence[int], count: int) -> tuple[int, ...]:
    return tuple(int(v) for v in _expand(name, values, count))


@dataclass(frozen=True)
class CostModel:
    """Per-stage durations and sizes, per-edge link costs. Stage ``k`` of ``num_stages``.

    Build one with :meth:`uniform`, :meth:`from_profile`, :meth:`from_stage_graph` or
    :meth:`from_plan`; the constructor checks lengths and signs.
    """

    forward_s: tuple[float, ...]
    """Seconds of one micro-batch's forward, per stage."""
    backward_s: tuple[float, ...]
    """Seconds of one micro-batch's backward (input and weight gradients), per stage."""
    update_s: tuple[float, ...]
    """Seconds of one optimizer step, per stage. 0 makes updates instantaneous."""
    predict_s: tuple[float, ...]
    """Extra seconds a forward on predicted weights spends computing them, per stage
    (added to the forward's duration; only forwards the version analysis marks predicted)."""
    param_bytes: tuple[int, ...]
    """Bytes of one weight copy, per stage. Gradients take as much again."""
    optimizer_state_bytes: tuple[int, ...]
    """Bytes of optimizer state, per stage (sgd with momentum 1x params, adam/adamw 2x,
    rmsprop 1x)."""
    activation_bytes: tuple[int, ...]
    """Bytes one micro-batch keeps on a stage from its forward until its backward ends."""
    send_forward_bytes: tuple[int, ...]
    """Bytes stage ``k`` sends to stage ``k+1`` per micro-batch (activation), per edge."""
    send_backward_bytes: tuple[int, ...]
    """Bytes stage ``k+1`` sends back to stage ``k`` per micro-batch (gradient), per edge."""
    latency_s: tuple[float, ...]
    """Seconds every transfer over an edge takes on top of its bytes / bandwidth."""
    bandwidth: tuple[float, ...]
    """Bytes per second of each edge (``math.inf``: bytes cost no time)."""
    samples_per_micro_batch: float = 1.0
    """Samples in one micro-batch of one replica; throughput is reported in samples per
    second over all replicas (``data_parallel`` times as many)."""
    optimizer: str = "sgd"
    """Optimizer family the state bytes are for."""
    data_parallel: int = 1
    """Replicas D of the pipeline (PP x DP). The model times one replica (they run alike)
    and reports the throughput of all of them."""
    allreduce_s: tuple[float, ...] = ()
    """Seconds of each stage's gradient all-reduce over its D replicas, per update (empty:
    none). It runs inside the update, blocking, so the update takes ``update_s +
    allreduce_s`` (:attr:`update_total_s`); :meth:`with_data_parallel` sets it."""
    weight_grad_fraction: float | tuple[float, ...] = 0.5
    """Share of a backward that computes the weight gradient, in [0, 1], per stage (one
    number is given to every stage; after construction it is always a tuple): where a
    schedule splits the backward (zero-bubble schedules), its weight part W takes this
    fraction of ``backward_s`` (:attr:`backward_weight_s`) and its input part I the rest
    (:attr:`backward_input_s`). :meth:`from_profile` takes each stage's from the profiled
    layers (``LayerProfile.weight_grad_fraction``, weighted by their backward times). The
    default 0.5 is the zero-bubble paper's T_I = T_W (for a matrix multiply both parts are
    one multiply of the same size)."""
    recompute_s: tuple[float, ...] = ()
    """Seconds each backward (a split backward's input half I) spends running the
    recomputed units' forward again, per stage (empty: no recomputation)."""
    rebuilt_activation_bytes: tuple[int, ...] = ()
    """Bytes a split backward holds from its I to its W: the recomputed units' activations,
    made again by the I (per stage; empty: none)."""
    held_weight_bytes: tuple[int, ...] = ()
    """Bytes of the recomputed units' weights, per stage: under the PREDICT policy every
    in-flight micro-batch that ran on predicted weights holds one copy until its backward
    (the recomputation must meet the Ŵ its forward read). Empty: none."""
    gather_s: tuple[float, ...] = ()
    """Seconds of each stage's weight all-gather per update under sharded optimizer state
    (:meth:`with_sharded_optimizer`); empty: none."""
    shard_optimizer: bool = False
    """Whether the optimizer state is sharded over the D replicas (ZeRO-1)."""
    message_send_s: float = 0.0
    """Fixed seconds the sending rank spends on each message to another rank (posting it
    to the transport), whatever its size: added to the action whose output it carries, so
    it occupies the rank (and its share of the cores). 0: messages cost only their link."""
    message_receive_s: float = 0.0
    """Fixed seconds the receiving rank spends on each message from another rank (taking it
    from the transport): added to the action that consumes it, after the link delivered it."""
    machine: Machine | None = None
    """The host the ranks share (:class:`~pipeoptim.plan.machine.Machine`). Where its busy
    ranks can ask for more cores than it has, the engines run them by processor sharing
    (:mod:`pipeoptim.sim.sharing`); None, or enough cores, is a core (or device) per rank."""
    action_s: tuple[float, ...] = ()
    """Fixed seconds the runtime works around each action beyond its layers (the executor's
    loop, the stage's weight versions and bookkeeping), for an F, B, U, I and W action in
    that order; empty: none (an action is its layers' time)."""

    def __post_init__(self) -> None:
        s = len(self.forward_s)
        if s < 1:
            raise PlanError("a cost model needs at least one stage (got 0 forward times)")
        e = s - 1
        for name in ("forward_s", "backward_s", "update_s", "predict_s"):
            object.__setattr__(self, name, _floats(name, getattr(self, name), s))
        for name in ("param_bytes", "optimizer_state_bytes", "activation_bytes"):
            object.__setattr__(self, name, _ints(name, getattr(self, name), s))
        for name in ("send_forward_bytes", "send_backward_bytes"):
            object.__setattr__(self, name, _ints(f"{name} (per edge)", getattr(self, name), e))
        object.__setattr__(self, "latency_s", _floats("latency_s (per edge)", self.latency_s, e))
        bw = _floats("bandwidth (per edge)", self.bandwidth, e)
        if any(b == 0 for b in bw):
            raise PlanError("bandwidth must be > 0 bytes/s on every edge (use inf for free links)")
        object.__setattr__(self, "bandwidth", bw)
        if not self.samples_per_micro_batch > 0:
            raise PlanError(
                f"samples_per_micro_batch must be > 0, got {self.samples_per_micro_batch}"
            )
        check_replicas(self.data_parallel, "data_parallel")
        ar = self.allreduce_s if len(self.allreduce_s) else (0.0,) * s
        object.__setattr__(self, "allreduce_s", _floats("allreduce_s", ar, s))
        for name in ("recompute_s", "gather_s"):
            given = getattr(self, name)
            object.__setattr__(self, name, _floats(name, given if len(given) else (0.0,) * s, s))
        for name in ("rebuilt_activation_bytes", "held_weight_bytes"):
            given = getattr(self, name)
            object.__setattr__(self, name, _ints(name, given if len(given) else (0,) * s, s))
        object.__setattr__(self, "weight_grad_fraction", _fractions(self.weight_grad_fraction, s))
        for name in ("message_send_s", "message_receive_s"):
            value = _seconds(getattr(self, name))
            if value is None:
                raise PlanError(
                    f"{name} is the fixed seconds of one message at one end and must be a "
                    f"finite number >= 0 (got {getattr(self, name)!r}); give e.g. 5e-05, or "
                    f"0 for messages that cost only their link"
                )
            object.__setattr__(self, name, value)
        if len(self.action_s):
            if len(self.action_s) != len(KIND_CODES):
                raise PlanError(
                    f"action_s needs one fixed time per action kind {', '.join(KIND_CODES)} "
                    f"(got {len(self.action_s)} values {tuple(self.action_s)!r}); give 5 "
                    f"numbers or none"
                )
            fixed: list[float] = []
            for kind, given in zip(KIND_CODES, self.action_s, strict=True):
                value = _seconds(given)
                if value is None:
                    raise PlanError(
                        f"action_s[{kind}] is the fixed seconds of one {kind} action beyond "
                        f"its layers and must be a finite number >= 0 (got {given!r}); give "
                        f"e.g. 5e-05, or 0 for none"
                    )
                fixed.append(value)
            object.__setattr__(self, "action_s", tuple(fixed))
        if self.machine is not None and not isinstance(self.machine, Machine):
            raise PlanError(
                f"machine must be a pipeoptim.plan.machine.Machine or None (got "
                f"{self.machine!r}); build one with Machine(cores, ranks_per_host, threads)"
            )

    # ------------------------------------------------------------------ derived
    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    @property
    def grad_bytes(self) -> tuple[int, ...]:
        """Bytes of the gradient buffer per stage (one parameter-sized copy)."""
        return self.param_bytes

    @property
    def update_total_s(self) -> tuple[float, ...]:
        """Seconds of every stage's update with its all-reduce (and its all-gather when the
        optimizer state is sharded): what a U action takes."""
        return tuple(
            u + a + g
            for u, a, g in zip(self.update_s, self.allreduce_s, self.gather_s, strict=True)
        )

    @property
    def charges_messages(self) -> bool:
        """Whether a message between ranks costs its ends any time."""
        return self.message_send_s > 0 or self.message_receive_s > 0

    @property
    def shares_cores(self) -> bool:
        """Whether the ranks take turns on their host's cores (:attr:`machine`)."""
        return self.machine is not None and self.machine.shares_cores

    @property
    def recomputes(self) -> bool:
        """Whether any stage recomputes (a backward runs a forward again)."""
        return any(self.recompute_s) or any(self.rebuilt_activation_bytes)

    @property
    def weight_grad_fractions(self) -> tuple[float, ...]:
        """:attr:`weight_grad_fraction`, typed as the per-stage tuple it is."""
        shares = self.weight_grad_fraction
        assert isinstance(shares, tuple)
        return shares

    @property
    def backward_weight_s(self) -> tuple[float, ...]:
        """Seconds of a split backward's weight part W, per stage:
        ``weight_grad_fraction * backward_s``."""
        return tuple(
            w * b for w, b in zip(self.weight_grad_fractions, self.backward_s, strict=True)
        )

    @property
    def backward_input_s(self) -> tuple[float, ...]:
        """Seconds of a split backward's input half I, per stage: the rest of the backward,
        ``backward_s - backward_weight_s``."""
        return tuple(b - w for b, w in zip(self.backward_s, self.backward_weight_s, strict=True))

    @property
    def global_samples_per_micro_batch(self) -> float:
        """Samples one micro-batch index trains over all replicas."""
        return self.samples_per_micro_batch * self.data_parallel

    def transfer_s(self, edge: int, backward: bool = False) -> float:
        """Seconds one micro-batch's activation (or gradient) takes over ``edge``."""
        size = (self.send_backward_bytes if backward else self.send_forward_bytes)[edge]
        bw = self.bandwidth[edge]
        return self.latency_s[edge] + (0.0 if size == 0 or math.isinf(bw) else size / bw)

    def bottleneck_s(self) -> float:
        """Largest per-stage ``forward + backward (+ recomputation) + update``: the async
        steady-state period."""
        return max(
            f + b + r + u
            for f, b, r, u in zip(
                self.forward_s, self.backward_s, self.recompute_s, self.update_total_s,
                strict=True,
            )
        )  # fmt: skip

    def with_links(
        self, *, latency_s: float | None = None, bandwidth: float | None = None
    ) -> CostModel:
        """The same model with every edge's latency and/or bandwidth replaced."""
        e = self.num_stages - 1
        return replace(
            self,
            latency_s=self.latency_s if latency_s is None else (latency_s,) * e,
            bandwidth=self.bandwidth if bandwidth is None else (bandwidth,) * e,
        )

    def with_data_parallel(
        self, replicas: int, cluster: Cluster, *, num_ranks: int | None = None
    ) -> CostModel:
        """The model of ``replicas`` replicas placed on ``cluster``
        (:mod:`pipeoptim.sim.collectives`): every edge gets the latency and bandwidth of
        its tier, every update its stage's ring all-reduce of ``grad_bytes`` over the
        replicas, and throughput counts all replicas. Stage s sits on pipeline rank
        ``s mod num_ranks`` (default: one stage per rank). The replicas' batch is what the
        model was built for: build it with each replica's share of the global batch."""
        links = edge_links(self.num_stages, replicas, cluster, num_ranks)
        return replace(
            self,
            latency_s=tuple(lat for _, lat in links),
            bandwidth=tuple(bw for bw, _ in links),
            data_parallel=replicas,
            allreduce_s=allreduce_times(self.grad_bytes, replicas, cluster, num_ranks),
        )

    def with_sharded_optimizer(
        self, cluster: Cluster, *, num_ranks: int | None = None
    ) -> CostModel:
        """The model with each stage's optimizer state sharded over its ``data_parallel``
        replicas (ZeRO-1): ``ceil(optimizer_state_bytes / D)`` per replica, ``update_s / D``
        (each replica steps its shard) and every update's all-gather of the stage's
        weights on ``cluster`` (:func:`~pipeoptim.sim.collectives.allgather_times`). A
        predicting method's replicas each predict their shard of Ŵ and broadcast it
        (``runtime/optim/sharded.py``): the same gather is added to ``predict_s``, which
        the simulator charges on predicted forwards only. Call it after
        :meth:`with_data_parallel`; it refuses D < 2."""
        d = self.data_parallel
        check_shard_optimizer(True, d, flag="--shard-optimizer")
        if self.shard_optimizer:
            return self
        gather = allgather_times(self.param_bytes, d, cluster, num_ranks)
        return replace(
            self,
            optimizer_state_bytes=tuple(-(-b // d) for b in self.optimizer_state_bytes),
            update_s=tuple(u / d for u in self.update_s),
            predict_s=tuple(p + g for p, g in zip(self.predict_s, gather, strict=True)),
            gather_s=gather,
            shard_optimizer=True,
        )

    def scaled(self, factor: float) -> CostModel:
        """Times (not bytes) multiplied by ``factor``: a faster or slower device. Link
        times, the all-reduce among them, stay as they are."""
        return replace(
            self,
            forward_s=tuple(v * factor for v in self.forward_s),
            backward_s=tuple(v * factor for v in self.backward_s),
            update_s=tuple(v * factor for v in self.update_s),
            predict_s=tuple(v * factor for v in self.predict_s),
            recompute_s=tuple(v * factor for v in self.recompute_s),
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def uniform(
        cls,
        num_stages: int,
        forward_s: float = 1.0,
        backward_s: float = 2.0,
        update_s: float = 0.0,
        *,
        predict_s: float = 0.0,
        param_bytes: int = 0,
        activation_bytes: int = 0,
        boundary_bytes: int | None = None,
        latency_s: float = 0.0,
        bandwidth: float = math.inf,
        optimizer: str = "sgd",
        momentum: bool | None = None,
        samples_per_micro_batch: float = 1.0,
        weight_grad_fraction: float | Sequence[float] = 0.5,
    ) -> CostModel:
        """Every stage alike. ``boundary_bytes`` (sent per micro-batch over each edge, both
        ways) defaults to ``activation_bytes``; optimizer state is ``param_bytes`` times the
        optimizer's factor; a split backward's W takes ``weight_grad_fraction`` of
        ``backward_s`` and its I the rest."""
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise PlanError(f"a cost model needs num_stages >= 1, got {num_stages!r}")
        sent = activation_bytes if boundary_bytes is None else boundary_bytes
        factor = optimizer_state_factor(optimizer, momentum=momentum)
        e = num_stages - 1
        return cls(
            forward_s=(forward_s,) * num_stages,
            backward_s=(backward_s,) * num_stages,
            update_s=(update_s,) * num_stages,
            predict_s=(predict_s,) * num_stages,
            param_bytes=(param_bytes,) * num_stages,
            optimizer_state_bytes=(factor * param_bytes,) * num_stages,
            activation_bytes=(activation_bytes,) * num_stages,
            send_forward_bytes=(sent,) * e,
            send_backward_bytes=(sent,) * e,
            latency_s=(latency_s,) * e,
            bandwidth=(bandwidth,) * e,
            samples_per_micro_batch=samples_per_micro_batch,
            optimizer=optimizer,
            weight_grad_fraction=_fractions(weight_grad_fraction, num_stages),
        )

    @classmethod
    def from_stages(
        cls,
        stages: Sequence[Mapping[str, Any]],
        edge_bytes: Sequence[int],
        *,
        micro_batches: int = 1,
        profile_batch: int = 1,
        batch_size: float | None = None,
        optimizer: str | None = None,
        source_optimizer: str = "sgd",
        update_s: float | Sequence[float] | None = None,
        predict_s: float | Sequence[float] | None = None,
        latency_s: float = 0.0,
        bandwidth: float = math.inf,
        weight_grad_fraction: float | Sequence[float] | None = None,
    ) -> CostModel:
        """From per-stage sums measured on ``profile_batch`` samples.

        ``stages[k]`` has ``forward_s, backward_s, param_bytes, optimizer_state_bytes,
        activation_bytes`` and optionally ``forward_fixed_s, backward_fixed_s, update_s,
        predict_s, weight_grad_s`` and, where it recomputes (:func:`_with_recompute`),
        ``kept_activation_bytes, rebuilt_activation_bytes, recompute_forward_s,
        recompute_forward_fixed_s, recompute_param_bytes``; ``edge_bytes[k]`` is what
        crosses edge ``k`` for that batch. A stage's weight-gradient share is
        ``weight_grad_s / backward_s`` (0.5 without ``weight_grad_s``, or without a
        backward), unless ``weight_grad_fraction``
        (one number or one per stage) is given.
        ``batch_size`` is the samples of one mini-batch (default: ``profile_batch``, i.e.
        the profile was measured on one mini-batch); a micro-batch has
        ``batch_size / micro_batches`` samples. Times scale from ``profile_batch`` to it
        with their fixed part kept (linearly when there is none), activation and transfer
        bytes linearly; parameter bytes, update and prediction times do not scale.
        ``update_s``/``predict_s`` given here replace the stages' own. Optimizer state is
        recomputed from the parameters when ``optimizer`` differs from
        ``source_optimizer``; so are the update and prediction times, which were measured
        with the other optimizer (they become 0: unknown).
        """
        if micro_batches < 1:
            raise PlanError(f"micro_batches must be >= 1, got {micro_batches}")
        mini = float(profile_batch if batch_size is None else batch_size)
        per_micro = mini / micro_batches
        scale = per_micro / profile_batch
        family = optimizer or source_optimizer
        same = family == source_optimizer
        if not same:
            factor = optimizer_state_factor(family)
            state = [factor * int(st["param_bytes"]) for st in stages]
        else:
            state = [int(st["optimizer_state_bytes"]) for st in stages]
        s = len(stages)
        sent = [round(int(b) * scale) for b in edge_bytes]

        def scaled(st: Mapping[str, Any], key: str) -> float:
            fixed = float(st.get(f"{key}_fixed_s", 0.0))
            return fixed + (float(st[f"{key}_s"]) - fixed) * scale

        def measured(key: str, given: float | Sequence[float] | None) -> tuple[float, ...]:
            if given is not None:
                return _floats(key, given, s)
            return tuple(float(st.get(key, 0.0)) if same else 0.0 for st in stages)

        def rescaled(st: Mapping[str, Any], key: str) -> int:
            return round(int(st.get(key, 0)) * scale)

        recomputing = any("kept_activation_bytes" in st for st in stages)
        extra: dict[str, Any] = {}
        if recomputing:
            extra = {
                "recompute_s": tuple(scaled(st, "recompute_forward") for st in stages),
                "rebuilt_activation_bytes": tuple(
                    rescaled(st, "rebuilt_activation_bytes") for st in stages
                ),
                "held_weight_bytes": tuple(
                    int(st.get("recompute_param_bytes", 0)) for st in stages
                ),
            }
        kept = "kept_activation_bytes" if recomputing else "activation_bytes"

        return cls(
            forward_s=tuple(scaled(st, "forward") for st in stages),
            backward_s=tuple(scaled(st, "backward") for st in stages),
            update_s=measured("update_s", update_s),
            predict_s=measured("predict_s", predict_s),
            param_bytes=tuple(int(st["param_bytes"]) for st in stages),
            optimizer_state_bytes=tuple(state),
            activation_bytes=tuple(
                round(int(st.get(kept, st["activation_bytes"])) * scale) for st in stages
            ),
            send_forward_bytes=tuple(sent),
            send_backward_bytes=tuple(sent),
            latency_s=(latency_s,) * (s - 1),
            bandwidth=(bandwidth,) * (s - 1),
            samples_per_micro_batch=per_micro,
            optimizer=family,
            weight_grad_fraction=(
                tuple(_stage_share(st) for st in stages)
                if weight_grad_fraction is None
                else _fractions(weight_grad_fraction, s)
            ),
            **extra,
        )

    @classmethod
    def from_profile(
        cls,
        profile: Profile,
        boundaries: Sequence[tuple[int, int]],
        micro_batches: int = 1,
        **options: Any,
    ) -> CostModel:
        """Sum the profile's layers per stage (``boundaries``: half-open layer ranges).

        The bytes crossing edge ``k`` are the output activation of stage ``k``'s last layer.
        Each stage's weight-gradient share is its layers' W seconds over their backward
        seconds (``LayerProfile.weight_grad_fraction``). ``options`` as for
        :meth:`from_stages` (``batch_size``, ``optimizer``, ``update_s``, ``predict_s``,
        ``latency_s``, ``bandwidth``, ``weight_grad_fraction``). ``recompute``: per stage
        the stage-local indices of the units it recomputes (None: none; see
        :func:`pipeoptim.plan.recompute_costs.stage_unit_sets`).
        """
        from pipeoptim.plan.graph import validate_boundaries

        recompute: Sequence[frozenset[int]] | None = options.pop("recompute", None)

        ranges = validate_boundaries(boundaries, profile.num_layers)
        stages = []
        for start, end in ranges:
            layers = profile.layers[start:end]
            stages.append(
                {
                    "forward_s": math.fsum(x.forward_s for x in layers),
                    "backward_s": math.fsum(x.backward_s for x in layers),
                    "forward_fixed_s": math.fsum(x.forward_fixed_s for x in layers),
                    "backward_fixed_s": math.fsum(x.backward_fixed_s for x in layers),
                    "weight_grad_s": math.fsum(x.weight_grad_s for x in layers),
                    "update_s": math.fsum(x.update_s for x in layers),
                    "predict_s": math.fsum(x.predict_s for x in layers),
                    "param_bytes": sum(x.param_bytes for x in layers),
                    "optimizer_state_bytes": sum(x.optimizer_state_bytes for x in layers),
                    "activation_bytes": sum(x.activation_bytes for x in layers),
                }
            )
        if recompute is not None:
            _with_recompute(stages, profile_unit_costs(profile), ranges, recompute)
        edges = [profile.layers[end - 1].activation_bytes for _, end in ranges[:-1]]
        return cls.from_stages(
            stages,
            edges,
            micro_batches=micro_batches,
            profile_batch=profile.batch_size,
            source_optimizer=profile.optimizer,
            **options,
        )

    @classmethod
    def from_stage_graph(
        cls, graph: nx.DiGraph, micro_batches: int = 1, **options: Any
    ) -> CostModel:
        """From :func:`pipeoptim.plan.graph.stage_graph` output (nodes 0..S-1, edge ``bytes``).

        ``recompute`` (an option): per stage the stage-local units it recomputes, which
        needs the per-unit costs a planned stage graph carries (:func:`graph_unit_costs`)."""
        recompute: Sequence[frozenset[int]] | None = options.pop("recompute", None)
        nodes = sorted(graph.nodes)
        stages = [dict(graph.nodes[k]) for k in nodes]
        if recompute is not None:
            units = graph_unit_costs(graph)
            ranges = [(int(st["start"]), int(st["end"])) for st in stages]
            _with_recompute(stages, units, ranges, recompute)
        edges = [int(graph.edges[a, b].get("bytes", 0)) for a, b in itertools.pairwise(nodes)]
        return cls.from_stages(
            stages,
            edges,
            micro_batches=micro_batches,
            profile_batch=int(graph.graph.get("batch_size", 1)),
            source_optimizer=str(graph.graph.get("optimizer", "sgd")),
            **options,
        )

    @classmethod
    def from_plan(cls, plan: Plan, profile: Profile | None = None, **options: Any) -> CostModel:
        """From a plan's stage graph, or from ``profile`` cut at the plan's boundaries.

        The plan's ``batch_size`` and optimizer family apply unless ``options`` override
        them.
        """
        options.setdefault("optimizer", plan.optimizer.family)
        if plan.batch_size is not None:
            options.setdefault("batch_size", plan.batch_size)
        m = plan.shape(1).micro_batches
        if plan.stage_graph is not None:
            from pipeoptim.plan.graph import stage_graph_from_dict

            graph = stage_graph_from_dict(plan.stage_graph)
            if plan.recompute is not None and "recompute" not in options:
                options["recompute"] = graph_recompute_sets(graph, plan.recompute)
            return cls.from_stage_graph(graph, m, **options)
        if profile is None:
            raise PlanError(
                "the plan has no stage graph with costs, so the simulator has no stage costs; "
                "pass --profile FILE (cut at the plan's boundaries) or use --uniform F,B"
            )
        stages = plan.num_stages * plan.virtual_stages
        if plan.boundaries is not None:
            bounds = plan.boundaries
        else:
            from pipeoptim.plan.plan import even_boundaries

            bounds = even_boundaries(profile.num_layers, stages)
        if plan.recompute is not None and "recompute" not in options:
            labels = labels_from_names([x.name for x in profile.layers])
            options["recompute"] = stage_unit_sets(plan.recompute, bounds, labels)
        return cls.from_profile(profile, bounds, m, **options)


def graph_recompute_sets(graph: nx.DiGraph, requested: object) -> list[frozenset[int]] | None:
    """What ``requested`` recomputes on ``graph``'s stages (units named as its
    ``layer_names`` name them)."""
    nodes = [graph.nodes[k] for k in sorted(graph.nodes)]
    names = [str(n) for node in nodes for n in node.get("layer_names", [])]
    ranges = [(int(node["start"]), int(node["end"])) for node in nodes]
    if len(names) != (ranges[-1][1] if ranges else 0):
        names = [str(i) for i in range(ranges[-1][1] if ranges else 0)]
    return stage_unit_sets(requested, ranges, labels_from_names(names))


def _with_recompute(
    stages: list[dict[str, Any]],
    units: UnitCosts,
    ranges: Sequence[tuple[int, int]],
    recompute: Sequence[frozenset[int]],
) -> None:
    """Add each stage's recomputation sums (at the profile batch) to its dict."""
    if len(recompute) != len(stages):
        raise PlanError(
            f"recompute needs one set of units per stage (got {len(recompute)} for "
            f"{len(stages)} stages)"
        )
    for st, (start, end), local in zip(stages, ranges, recompute, strict=True):
        r = stage_recompute(units, start, end, frozenset(local))
        st["kept_activation_bytes"] = r.kept_activation_bytes
        st["rebuilt_activation_bytes"] = r.rebuilt_activation_bytes
        st["recompute_forward_s"] = r.forward_s
        st["recompute_forward_fixed_s"] = r.forward_fixed_s
        st["recompute_param_bytes"] = r.param_bytes


def _stage_share(stage: Mapping[str, Any]) -> float:
    """A stage's weight-gradient share from its summed ``weight_grad_s`` and
    ``backward_s`` (0.5 when it has no ``weight_grad_s`` or no backward)."""
    backward = float(stage["backward_s"])
    weight = stage.get("weight_grad_s")
    if weight is None or not backward > 0:
        return 0.5
    return min(1.0, max(0.0, float(weight) / backward))


def parse_uniform(text: str) -> tuple[float, float, float]:
    """Parse ``"F,B"`` or ``"F,B,U"`` (seconds per micro-batch and per update)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or any(not math.isfinite(v) or v < 0 for v in values):
        raise PlanError(
            f"--uniform takes forward and backward seconds per stage, optionally the update "
            f"seconds, as 'F,B' or 'F,B,U' with numbers >= 0 (got {text!r}); e.g. --uniform 1,2"
        )
    return values[0], values[1], values[2] if len(values) == 3 else 0.0
