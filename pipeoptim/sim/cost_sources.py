"""A cost model built from measured costs: per-stage sums of a profile's layers, a planned
stage graph, or a plan (the constructors ``CostModel.from_stages``, ``from_profile``,
``from_stage_graph`` and ``from_plan``), with activation recomputation's sums per stage.

Apart from :mod:`pipeoptim.sim.costs` because scaling measurements (profile batch to
micro-batch, one optimizer's state to another's, recomputed units) is its own concern; the
functions take the class as ``cls`` and :class:`~pipeoptim.sim.costs.CostModel` binds them
as its class methods, so ``CostModel.from_profile(...)`` is how they are called.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeoptim.errors import PlanError
from pipeoptim.plan.kept_bytes import stage_kept_bytes
from pipeoptim.plan.profile import optimizer_state_factor
from pipeoptim.plan.recompute_costs import (
    UnitCosts,
    graph_unit_costs,
    labels_from_names,
    profile_unit_costs,
    stage_recompute,
    stage_unit_sets,
)
from pipeoptim.sim.cost_checks import stage_floats, weight_grad_shares

if TYPE_CHECKING:
    import networkx as nx

    from pipeoptim.plan.plan import Plan
    from pipeoptim.plan.profile import Profile
    from pipeoptim.sim.costs import CostModel

__all__ = ["from_plan", "from_profile", "from_stage_graph", "from_stages", "graph_recompute_sets"]


def from_stages(
    cls: type[CostModel],
    /,
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
    prediction_setup_s: float | Sequence[float] | None = None,
    latency_s: float = 0.0,
    bandwidth: float = math.inf,
    weight_grad_fraction: float | Sequence[float] | None = None,
) -> CostModel:
    """From per-stage sums measured on ``profile_batch`` samples.

    ``stages[k]`` has ``forward_s, backward_s, param_bytes, optimizer_state_bytes,
    activation_bytes`` and optionally ``forward_fixed_s, backward_fixed_s, update_s,
    predict_s, prediction_setup_s, weight_grad_s`` and, where it recomputes
    (:func:`_with_recompute`),
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
    ``update_s``/``predict_s``/``prediction_setup_s`` given here replace the stages' own.
    Optimizer state is recomputed from the parameters when ``optimizer`` differs from
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
            return stage_floats(key, given, s)
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
            "held_weight_bytes": tuple(int(st.get("recompute_param_bytes", 0)) for st in stages),
        }
    kept = "kept_activation_bytes" if recomputing else "activation_bytes"

    return cls(
        forward_s=tuple(scaled(st, "forward") for st in stages),
        backward_s=tuple(scaled(st, "backward") for st in stages),
        update_s=measured("update_s", update_s),
        predict_s=measured("predict_s", predict_s),
        prediction_setup_s=measured("prediction_setup_s", prediction_setup_s),
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
            else weight_grad_shares(weight_grad_fraction, s)
        ),
        **extra,
    )


def from_profile(
    cls: type[CostModel],
    /,
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
    ``prediction_setup_s``, ``latency_s``, ``bandwidth``, ``weight_grad_fraction``).
    ``recompute``: per stage the stage-local indices of the units it recomputes (None: none; see
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
                "prediction_setup_s": math.fsum(x.prediction_setup_s or 0.0 for x in layers),
                "param_bytes": sum(x.param_bytes for x in layers),
                "optimizer_state_bytes": sum(x.optimizer_state_bytes for x in layers),
                "activation_bytes": stage_kept_bytes(layers),
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


def from_stage_graph(
    cls: type[CostModel], /, graph: nx.DiGraph, micro_batches: int = 1, **options: Any
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


def from_plan(
    cls: type[CostModel], /, plan: Plan, profile: Profile | None = None, **options: Any
) -> CostModel:
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
