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

The measured ones are built in :mod:`pipeoptim.sim.cost_sources`; the checks every value
passes are :mod:`pipeoptim.sim.cost_checks`.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeoptim.errors import PlanError
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.orders import KIND_CODES
from pipeoptim.plan.profile import optimizer_state_factor
from pipeoptim.plan.recompute import check_shard_optimizer
from pipeoptim.plan.recompute_costs import UNIT_KEYS, annotate_units
from pipeoptim.plan.replicas import check_replicas
from pipeoptim.sim import cost_sources
from pipeoptim.sim.collectives import Cluster, allgather_times, allreduce_times, edge_links
from pipeoptim.sim.cost_checks import (
    seconds_or_none,
    stage_floats,
    stage_ints,
    weight_grad_shares,
)
from pipeoptim.sim.cost_sources import graph_recompute_sets

__all__ = ["UNIT_KEYS", "CostModel", "annotate_units", "graph_recompute_sets", "parse_uniform"]


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
    """Extra seconds a forward on predicted weights spends writing them, per stage (added
    to the duration of a forward that writes a prediction: the first of the forwards the
    version analysis marks predicted at one distance between two updates)."""
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
    prediction_setup_s: tuple[float, ...] = ()
    """Seconds a predicting stage spends once per update computing the direction Δ its
    predictor keeps for the writes until the next update (Muon's Newton–Schulz, basis
    rotation's rotations: ``keeps_deltas``), per stage. The runtime computes it at the end
    of the update after which a forward predicts (``Stage._prepare_deltas``), so it is
    added to that U's duration, not to the forward's. Empty or 0: none (older profiles,
    whose ``predict_s`` holds all of it)."""
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
            object.__setattr__(self, name, stage_floats(name, getattr(self, name), s))
        for name in ("param_bytes", "optimizer_state_bytes", "activation_bytes"):
            object.__setattr__(self, name, stage_ints(name, getattr(self, name), s))
        for name in ("send_forward_bytes", "send_backward_bytes"):
            object.__setattr__(self, name, stage_ints(f"{name} (per edge)", getattr(self, name), e))
        object.__setattr__(
            self, "latency_s", stage_floats("latency_s (per edge)", self.latency_s, e)
        )
        bw = stage_floats("bandwidth (per edge)", self.bandwidth, e)
        if any(b == 0 for b in bw):
            raise PlanError("bandwidth must be > 0 bytes/s on every edge (use inf for free links)")
        object.__setattr__(self, "bandwidth", bw)
        if not self.samples_per_micro_batch > 0:
            raise PlanError(
                f"samples_per_micro_batch must be > 0, got {self.samples_per_micro_batch}"
            )
        check_replicas(self.data_parallel, "data_parallel")
        ar = self.allreduce_s if len(self.allreduce_s) else (0.0,) * s
        object.__setattr__(self, "allreduce_s", stage_floats("allreduce_s", ar, s))
        for name in ("recompute_s", "gather_s", "prediction_setup_s"):
            given = getattr(self, name)
            object.__setattr__(
                self, name, stage_floats(name, given if len(given) else (0.0,) * s, s)
            )
        for name in ("rebuilt_activation_bytes", "held_weight_bytes"):
            given = getattr(self, name)
            object.__setattr__(self, name, stage_ints(name, given if len(given) else (0,) * s, s))
        object.__setattr__(
            self, "weight_grad_fraction", weight_grad_shares(self.weight_grad_fraction, s)
        )
        for name in ("message_send_s", "message_receive_s"):
            value = seconds_or_none(getattr(self, name))
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
                value = seconds_or_none(given)
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
        the simulator charges on predicted forwards only; each replica computes its shard's
        kept Δ (``prediction_setup_s / D``). Call it after
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
            prediction_setup_s=tuple(v / d for v in self.prediction_setup_s),  # its shard's Δ
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
            prediction_setup_s=tuple(v * factor for v in self.prediction_setup_s),
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
        prediction_setup_s: float = 0.0,
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
            prediction_setup_s=(prediction_setup_s,) * num_stages,
            param_bytes=(param_bytes,) * num_stages,
            optimizer_state_bytes=(factor * param_bytes,) * num_stages,
            activation_bytes=(activation_bytes,) * num_stages,
            send_forward_bytes=(sent,) * e,
            send_backward_bytes=(sent,) * e,
            latency_s=(latency_s,) * e,
            bandwidth=(bandwidth,) * e,
            samples_per_micro_batch=samples_per_micro_batch,
            optimizer=optimizer,
            weight_grad_fraction=weight_grad_shares(weight_grad_fraction, num_stages),
        )

    # built from measured costs (pipeoptim.sim.cost_sources): one signature, one docstring
    from_stages = classmethod(cost_sources.from_stages)
    from_profile = classmethod(cost_sources.from_profile)
    from_stage_graph = classmethod(cost_sources.from_stage_graph)
    from_plan = classmethod(cost_sources.from_plan)


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
