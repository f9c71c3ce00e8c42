"""Layer graph and stage graph: the model and the pipeline as networkx DiGraphs.

The layer graph is the profile as a chain (one node per layer with its costs, one edge per
activation handed to the next layer). A partition cuts that chain into contiguous stages; the
stage graph is the pipeline the plan runs: one node per stage with the stage's summed costs
and its memory footprint under the chosen method, one edge per stage boundary carrying the
bytes that cross it. The simulator, the runtime and the report read stage costs from the
stage graph, and the plan file stores it (:func:`stage_graph_to_dict`).

Stage memory, used here and by the partitioner (one formula for both)::

    memory_bytes = weight_copies * param_bytes       # live weight versions
                 + param_bytes                       # gradients
                 + optimizer_state_bytes
                 + activation_slots * activation_bytes   # stashed for in-flight backwards

where ``activation_bytes`` is what the stage's layers save for the backward of one batch of
``Profile.batch_size`` samples, with the output it sends (:mod:`pipeoptim.plan.kept_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import networkx as nx
from pydantic import ConfigDict, StrictStr, with_config
from typing_extensions import Required, TypedDict

from pipeoptim.errors import PlanError
from pipeoptim.filecheck import (
    NonNegativeNumber,
    NonNegativeWhole,
    PositiveWhole,
    Whole,
    WholeNumber,
    check,
)
from pipeoptim.plan.kept_bytes import stage_kept_bytes
from pipeoptim.plan.limits import MAX_STAGE_BYTES
from pipeoptim.plan.profile import Profile

__all__ = [
    "STAGE_GRAPH_FORMAT",
    "STAGE_GRAPH_VERSION",
    "StageGraphFile",
    "layer_graph",
    "stage_graph",
    "stage_graph_from_dict",
    "stage_graph_to_dict",
    "stage_memory_bytes",
    "validate_boundaries",
]

STAGE_GRAPH_FORMAT = "pipeoptim.stage_graph"
STAGE_GRAPH_VERSION = 1

StageBytes = Annotated[int, Whole(ge=0, le=MAX_STAGE_BYTES)]


@with_config(ConfigDict(extra="allow"))
class StageFile(TypedDict, total=False):
    """One stage of a stored stage graph (the node attributes of :func:`stage_graph`, in
    the order it writes them, which a checked stage keeps)."""

    index: Required[NonNegativeWhole]
    start: Required[NonNegativeWhole]
    end: Required[NonNegativeWhole]
    layers: Required[list[NonNegativeWhole]]
    layer_names: Required[list[StrictStr]]
    forward_s: Required[NonNegativeNumber]
    backward_s: Required[NonNegativeNumber]
    forward_fixed_s: NonNegativeNumber
    backward_fixed_s: NonNegativeNumber
    weight_grad_s: NonNegativeNumber
    update_s: NonNegativeNumber
    predict_s: NonNegativeNumber
    param_bytes: Required[StageBytes]
    grad_bytes: Required[StageBytes]
    optimizer_state_bytes: Required[StageBytes]
    activation_bytes: Required[StageBytes]
    weight_copies: Required[PositiveWhole]
    activation_slots: Required[NonNegativeWhole]
    memory_bytes: Required[StageBytes]
    param_count: Required[StageBytes]
    prediction_setup_s: NonNegativeNumber  # last: written only where a layer measured it


@with_config(ConfigDict(extra="allow"))
class StageGraphAttrs(TypedDict, total=False):
    """The stored stage graph's graph attributes."""

    batch_size: PositiveWhole
    optimizer: StrictStr
    device: StrictStr
    dtype_bytes: PositiveWhole
    num_layers: NonNegativeWhole
    threads: PositiveWhole


@with_config(ConfigDict(extra="allow"))
class StageEdgeFile(TypedDict, total=False):
    """One edge (stage boundary) of a stored stage graph."""

    source: Required[NonNegativeWhole]
    target: Required[NonNegativeWhole]
    bytes: StageBytes


@with_config(ConfigDict(extra="allow"))
class StageGraphFile(TypedDict, total=False):
    """A stage graph as :func:`stage_graph_to_dict` writes it (a plan file's
    ``stage_graph``); unknown keys are kept, for newer files."""

    format: StrictStr
    version: Required[WholeNumber]
    graph: Required[StageGraphAttrs]
    stages: Required[list[StageFile]]
    edges: Required[list[StageEdgeFile]]


def stage_memory_bytes(
    param_bytes: int,
    optimizer_state_bytes: int,
    activation_bytes: int,
    weight_copies: int,
    activation_slots: int,
) -> int:
    """Peak memory of one stage, in bytes (formula in the module docstring)."""
    return (
        weight_copies * param_bytes
        + param_bytes
        + optimizer_state_bytes
        + activation_slots * activation_bytes
    )


def validate_boundaries(
    boundaries: Sequence[tuple[int, int]], num_layers: int
) -> list[tuple[int, int]]:
    """Check that ``boundaries`` cut layers ``0..num_layers`` into non-empty contiguous ranges.

    Each entry is a half-open ``(start, end)`` layer range, one per stage, in stage order;
    returns them as a list of int tuples.
    """
    hint = (
        "boundaries must be half-open (start, end) layer ranges, one per stage, that start "
        f"at 0, end at {num_layers} and each begin where the previous one ends, e.g. "
        "[(0, 3), (3, 6)]"
    )
    if len(boundaries) == 0:
        raise PlanError(f"no stages given; {hint}")
    result: list[tuple[int, int]] = []
    expected_start = 0
    for stage, entry in enumerate(boundaries):
        try:
            start, end = (int(v) for v in entry)
        except (TypeError, ValueError):
            raise PlanError(f"stage {stage} has boundary {entry!r}; {hint}") from None
        if start != expected_start:
            raise PlanError(
                f"stage {stage} starts at layer {start} but the previous stage ends at "
                f"{expected_start} (got {list(boundaries)!r}); {hint}"
            )
        if end <= start:
            raise PlanError(
                f"stage {stage} is empty or reversed: ({start}, {end}) (got "
                f"{list(boundaries)!r}); {hint}"
            )
        result.append((start, end))
        expected_start = end
    if expected_start != num_layers:
        raise PlanError(
            f"the stages end at layer {expected_start} but the profile has {num_layers} layers "
            f"(got {list(boundaries)!r}); {hint}"
        )
    return result


def layer_graph(profile: Profile) -> nx.DiGraph:
    """The profile as a chain ``nx.DiGraph``.

    Node ``i`` is layer ``i`` with attributes ``name, forward_s, backward_s,
    activation_bytes, param_bytes, optimizer_state_bytes, param_count``; edge ``i -> i+1``
    has ``bytes`` = layer ``i``'s output activation bytes. Graph attributes: ``batch_size,
    optimizer, device, dtype_bytes``.
    """
    graph = nx.DiGraph(
        batch_size=profile.batch_size,
        optimizer=profile.optimizer,
        device=profile.device,
        dtype_bytes=profile.dtype_bytes,
    )
    for index, layer in enumerate(profile.layers):
        graph.add_node(
            index,
            name=layer.name,
            forward_s=layer.forward_s,
            backward_s=layer.backward_s,
            activation_bytes=layer.activation_bytes,
            param_bytes=layer.param_bytes,
            optimizer_state_bytes=layer.optimizer_state_bytes,
            param_count=layer.param_count,
        )
    nx.add_path(graph, range(profile.num_layers))
    for index in range(profile.num_layers - 1):
        graph.edges[index, index + 1]["bytes"] = profile.layers[index].activation_bytes
    return graph


def _per_stage(name: str, value: int | Sequence[int], num_stages: int) -> list[int]:
    values = [value] * num_stages if isinstance(value, int) else list(value)
    if len(values) != num_stages:
        raise PlanError(
            f"{name} needs one value per stage: got {len(values)} values for {num_stages} "
            "stages; pass a single int or a list with one entry per stage"
        )
    for stage, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanError(f"{name} of stage {stage} must be a whole number >= 0, got {v!r}")
    return values


def stage_graph(
    profile: Profile,
    boundaries: Sequence[tuple[int, int]],
    *,
    weight_copies: int | Sequence[int] = 1,
    activation_slots: int | Sequence[int] = 1,
) -> nx.DiGraph:
    """The pipeline as a chain ``nx.DiGraph`` with one node per stage.

    ``boundaries`` are half-open ``(start, end)`` layer ranges, one per stage.
    ``weight_copies`` and ``activation_slots`` (one int for all stages or one per stage) are
    the method's memory factors, e.g. from
    :func:`pipeoptim.plan.memory_factors.method_memory_factors`.

    Node ``k`` attributes: ``start, end, layers`` (list of layer indices), ``layer_names``,
    ``forward_s, backward_s, forward_fixed_s, backward_fixed_s, update_s, predict_s``
    (summed), ``prediction_setup_s`` (summed, only where a layer measured it),
    ``weight_grad_s`` (the backward's weight-gradient seconds, summed),
    ``param_bytes, grad_bytes, optimizer_state_bytes, activation_bytes`` (summed),
    ``weight_copies, activation_slots, memory_bytes``, ``param_count``. The graph keeps the
    profile's ``threads`` (CPU threads it was measured with) when it recorded them, and the
    host it was taken for (``machine``, ``ranks``, ``runtime_costs``) where it says. Edge
    ``k -> k+1`` has ``bytes``: the activation of stage ``k``'s last layer, sent forward
    once per batch (its gradient, the same size, comes back).
    """
    stages = validate_boundaries(boundaries, profile.num_layers)
    copies = _per_stage("weight_copies", weight_copies, len(stages))
    slots = _per_stage("activation_slots", activation_slots, len(stages))
    graph = nx.DiGraph(
        batch_size=profile.batch_size,
        optimizer=profile.optimizer,
        device=profile.device,
        dtype_bytes=profile.dtype_bytes,
        num_layers=profile.num_layers,
    )
    threads = profile.meta.get("threads")
    if isinstance(threads, int) and threads >= 1:
        graph.graph["threads"] = threads
    for key in ("machine", "ranks"):  # the host the profile was taken for (sim/host.py)
        if profile.meta.get(key) is not None:
            graph.graph[key] = profile.meta[key]
    if profile.runtime_costs is not None:
        graph.graph["runtime_costs"] = profile.runtime_costs.to_dict()
    for k, (start, end) in enumerate(stages):
        layers = profile.layers[start:end]
        param = sum(layer.param_bytes for layer in layers)
        state = sum(layer.optimizer_state_bytes for layer in layers)
        act = stage_kept_bytes(layers)
        graph.add_node(
            k,
            start=start,
            end=end,
            layers=list(range(start, end)),
            layer_names=[layer.name for layer in layers],
            forward_s=sum(layer.forward_s for layer in layers),
            backward_s=sum(layer.backward_s for layer in layers),
            forward_fixed_s=sum(layer.forward_fixed_s for layer in layers),
            backward_fixed_s=sum(layer.backward_fixed_s for layer in layers),
            weight_grad_s=sum(layer.weight_grad_s for layer in layers),
            update_s=sum(layer.update_s for layer in layers),
            predict_s=sum(layer.predict_s for layer in layers),
            param_bytes=param,
            grad_bytes=param,
            optimizer_state_bytes=state,
            activation_bytes=act,
            weight_copies=copies[k],
            activation_slots=slots[k],
            memory_bytes=stage_memory_bytes(param, state, act, copies[k], slots[k]),
            param_count=sum(layer.param_count for layer in layers),
        )
        setups = [layer.prediction_setup_s for layer in layers]
        if any(x is not None for x in setups):  # stored graphs of older profiles stay as they were
            graph.nodes[k]["prediction_setup_s"] = sum(x or 0.0 for x in setups)
    nx.add_path(graph, range(len(stages)))
    for k, (_, end) in enumerate(stages[:-1]):
        graph.edges[k, k + 1]["bytes"] = profile.layers[end - 1].activation_bytes
    return graph


def stage_graph_to_dict(graph: nx.DiGraph) -> dict[str, Any]:
    """A JSON-able dict of a stage graph (for the plan file); inverse of
    :func:`stage_graph_from_dict`."""
    stages = []
    for k in sorted(graph.nodes):
        attrs = dict(graph.nodes[k])
        stages.append({"index": int(k), **attrs})
    edges = [
        {"source": int(u), "target": int(v), **dict(data)}
        for u, v, data in sorted(graph.edges(data=True), key=lambda e: (e[0], e[1]))
    ]
    return {
        "format": STAGE_GRAPH_FORMAT,
        "version": STAGE_GRAPH_VERSION,
        "graph": dict(graph.graph),
        "stages": stages,
        "edges": edges,
    }


def stage_graph_from_dict(data: object, source: str = "the stage graph") -> nx.DiGraph:
    """Rebuild a stage graph from :func:`stage_graph_to_dict` output (checked as a
    :class:`StageGraphFile`; stages numbered 0..S-1, joined k -> k+1)."""
    fix = "write it with stage_graph_to_dict (or regenerate the plan)"
    checked = check(StageGraphFile, data, source=source, remedy=fix, error=PlanError)
    if checked["version"] != STAGE_GRAPH_VERSION:
        raise PlanError(
            f"{source} has version {checked['version']!r}; this pipeoptim reads version "
            f"{STAGE_GRAPH_VERSION}; {fix}"
        )
    graph = nx.DiGraph(**checked["graph"])
    stages = checked["stages"]
    if not stages:
        raise PlanError(f"{source}'s 'stages' must be a non-empty list; {fix}")
    indices = sorted(raw["index"] for raw in stages)
    if indices != list(range(len(stages))):
        raise PlanError(
            f"{source} numbers its stages {indices[:10]}; they must be 0..{len(stages) - 1}, "
            f"each once; {fix}"
        )
    for raw in stages:
        attrs = {key: value for key, value in raw.items() if key != "index"}
        graph.add_node(raw["index"], **attrs)
    for position, edge in enumerate(checked["edges"]):
        u, v = edge["source"], edge["target"]
        if u not in graph or v not in graph:
            raise PlanError(f"{source}: edges[{position}] joins unknown stages {u} -> {v}; {fix}")
        attrs = {key: value for key, value in edge.items() if key not in ("source", "target")}
        graph.add_edge(u, v, **attrs)
    missing = [k for k in range(len(stages) - 1) if not graph.has_edge(k, k + 1)]
    if missing:
        k = missing[0]
        raise PlanError(f"{source} has no edge {k} -> {k + 1}; stages form a chain; {fix}")
    return graph
