"""What activation recomputation changes in a stage's memory and time, per unit.

Torch-free; read by the simulator's cost model (:mod:`pipeoptim.sim.costs`) and the
partitioner (:mod:`pipeoptim.plan.partition`), so both charge one formula. For a stage
holding units ``[start, end)`` of which the set ``R`` is recomputed (``a_l``: what unit
``l`` saves for its backward other than its output, ``s_l`` of :mod:`pipeoptim.plan.kept_bytes`;
``o_l``: the output a stage ending with ``l`` keeps; ``x_l``: what enters it, the output of
``l-1`` (the profile's ``activation_bytes``), or the model's input for unit 0; ``f_l``: its
forward seconds; ``w_l``: its parameter bytes), per micro-batch in flight::

    kept     = Σ_{l ∉ R} a_l + Σ_{l ∈ R, l-1 ∉ R} x_l   # held from forward to backward
               + o_{end-1} if end-1 ∉ R                 # the output, until the backward
    rebuilt  = Σ_{l ∈ R} a_l                       # what the recomputation makes again
    extra_s  = Σ_{l ∈ R} f_l                       # one more forward of R in each backward
    held_w   = Σ_{l ∈ R} w_l                       # PREDICT: the Ŵ the recomputation must meet

A run of consecutive recomputed units is one region that keeps only its first unit's input
(the runtime's ``stage/recompute.py``), so recomputing a whole stage keeps the stage's input;
a stage whose last unit is recomputed lets its output go once sent.
``rebuilt`` is held from a split backward's input half I (which recomputes) to its weight
half W; an unsplit backward frees it as it goes (the runtime counts what a stage stores
between actions, not the transient inside one). ``held_w`` is kept per in-flight
micro-batch that ran on predicted weights (an update falls between its forward and its
backward, so the current weights differ from the ones the forward read); stashing and
flushing policies keep their version anyway and hold nothing more.

The model's input bytes come from the profile's ``meta`` (``input_shape``,
``input_dtype``, as the profiler records them); a profile without them takes unit 0's
input as large as its output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeoptim.errors import PipeoptimError, PlanError
from pipeoptim.plan.kept_bytes import output_kept_bytes, unit_saved_bytes
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.recompute import (
    RecomputeEntry,
    UnitLabels,
    recompute_units,
    resolve_recompute,
)

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "UNIT_KEYS",
    "StageRecompute",
    "UnitCosts",
    "annotate_units",
    "graph_unit_costs",
    "labels_from_names",
    "model_input_bytes",
    "profile_unit_costs",
    "stage_recompute",
    "stage_unit_sets",
]

_DTYPE_BYTES = {
    "float64": 8, "double": 8, "int64": 8, "long": 8, "complex64": 8,
    "float32": 4, "float": 4, "int32": 4, "int": 4,
    "float16": 2, "half": 2, "bfloat16": 2, "int16": 2, "short": 2,
    "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip


@dataclass(frozen=True)
class UnitCosts:
    """Per unit of a model (pipeline order), at the profile's batch."""

    forward_s: tuple[float, ...]
    forward_fixed_s: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    """``a_l``: what the unit keeps for its backward without recomputation, its output
    aside."""
    input_bytes: tuple[int, ...]
    """``x_l``: what enters the unit (the previous unit's output; the model input for 0)."""
    param_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...] = ()
    """``o_l``: what a stage ending with the unit keeps of its output (empty: 0 each)."""

    def output_kept(self, unit: int) -> int:
        """``o_unit`` (0 where not given)."""
        return self.output_bytes[unit] if self.output_bytes else 0

    def __len__(self) -> int:
        return len(self.forward_s)


@dataclass(frozen=True)
class StageRecompute:
    """One stage's recomputation, per micro-batch of the profile's batch (module doc)."""

    units: frozenset[int]
    """Stage-local indices of the recomputed units."""
    kept_activation_bytes: int
    rebuilt_activation_bytes: int
    forward_s: float
    forward_fixed_s: float
    param_bytes: int


def model_input_bytes(profile: Profile) -> int | None:
    """Bytes of the model's input for one profile batch, from ``meta`` (None: unknown);
    the recorded shape's first dimension is taken as its batch."""
    shape, dtype = profile.meta.get("input_shape"), profile.meta.get("input_dtype")
    if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape):
        return None
    width = _DTYPE_BYTES.get(str(dtype).removeprefix("torch."))
    if width is None or not shape or shape[0] < 1:
        return None
    # the sample's first dimension is its batch: scale to the profile's (a per-unit
    # profile's batch is a micro-batch of it)
    total: int = math.prod(shape) * width * profile.batch_size
    return -(-total // int(shape[0]))


def profile_unit_costs(profile: Profile) -> UnitCosts:
    """The per-unit numbers of ``profile`` the module's formula reads."""
    layers = profile.layers
    outs = tuple(x.activation_bytes for x in layers)
    first = model_input_bytes(profile)
    return UnitCosts(
        forward_s=tuple(x.forward_s for x in layers),
        forward_fixed_s=tuple(x.forward_fixed_s for x in layers),
        activation_bytes=tuple(unit_saved_bytes(x) for x in layers),
        input_bytes=(outs[0] if first is None else first, *outs[:-1]),
        param_bytes=tuple(x.param_bytes for x in layers),
        output_bytes=tuple(output_kept_bytes(x) for x in layers),
    )


def stage_recompute(
    units: UnitCosts, start: int, end: int, local: frozenset[int]
) -> StageRecompute:
    """The module's sums for a stage of units ``[start, end)`` recomputing ``local``."""
    chosen = sorted(start + i for i in local)
    mine = range(start, end)
    kept = sum(units.activation_bytes[u] for u in mine if u - start not in local)
    # a run of consecutive recomputed units keeps only its first unit's input
    kept += sum(units.input_bytes[u] for u in chosen if u == start or u - 1 - start not in local)
    if end - 1 - start not in local:  # a recomputed last unit's output is let go once sent
        kept += units.output_kept(end - 1)
    return StageRecompute(
        frozenset(local),
        kept,
        sum(units.activation_bytes[u] for u in chosen),
        math.fsum(units.forward_s[u] for u in chosen),
        math.fsum(units.forward_fixed_s[u] for u in chosen),
        sum(units.param_bytes[u] for u in chosen),
    )


def labels_from_names(names: Sequence[str]) -> UnitLabels:
    """Unit labels from profile layer names ``"NAME:Class"`` (a name without a class is
    its own class)."""
    parts = [n.rsplit(":", 1) if ":" in n else [n, n] for n in names]
    return UnitLabels(tuple(p[0] for p in parts), tuple(p[1] for p in parts))


def stage_unit_sets(
    requested: object,
    boundaries: Sequence[tuple[int, int]],
    labels: UnitLabels,
    *,
    error: type[PipeoptimError] = PlanError,
) -> list[frozenset[int]] | None:
    """What ``requested`` (a plan's entries, a ``--recompute`` value...) recomputes: per
    stage the stage-local unit indices, or None for nothing."""
    entries: list[RecomputeEntry] | None = resolve_recompute(
        requested, boundaries, labels, error=error
    )
    if entries is None:
        return None
    sets = [
        recompute_units(entry, start, end, labels)
        for entry, (start, end) in zip(entries, boundaries, strict=True)
    ]
    return sets if any(sets) else None


UNIT_KEYS = (
    "unit_forward_s",
    "unit_forward_fixed_s",
    "unit_activation_bytes",
    "unit_input_bytes",
    "unit_param_bytes",
)
"""The per-unit lists a planned stage graph's nodes carry (:func:`annotate_units`), so a
plan's recomputation can be costed without the profile."""

OUTPUT_KEY = "unit_output_bytes"
"""``o_l`` per unit on a stage graph's node; plans written before it have none (0 each)."""


def annotate_units(graph: nx.DiGraph, units: UnitCosts) -> nx.DiGraph:
    """``graph`` (a stage graph of ``units``' model) with each stage's per-unit costs on its
    node (:data:`UNIT_KEYS`, stage-local lists); returns the same graph."""
    fields = ("forward_s", "forward_fixed_s", "activation_bytes", "input_bytes", "param_bytes")
    for k in graph.nodes:
        node = graph.nodes[k]
        start, end = int(node["start"]), int(node["end"])
        for key, name in zip(UNIT_KEYS, fields, strict=True):
            node[key] = list(getattr(units, name)[start:end])
        node[OUTPUT_KEY] = [units.output_kept(u) for u in range(start, end)]
    return graph


def graph_unit_costs(graph: nx.DiGraph) -> UnitCosts:
    """The per-unit costs a stage graph's nodes carry (:func:`annotate_units`)."""
    nodes = [graph.nodes[k] for k in sorted(graph.nodes)]
    missing = [k for k, node in enumerate(nodes) if any(key not in node for key in UNIT_KEYS)]
    if missing:
        raise PlanError(
            f"the plan's stage graph has no per-unit costs (stage {missing[0]} lacks "
            f"{UNIT_KEYS[0]}...), so its recomputation cannot be costed; pass --profile FILE "
            f"(cut at the plan's boundaries), or re-plan with `pipeoptim plan`, which writes them"
        )
    lists = [[x for node in nodes for x in node[key]] for key in UNIT_KEYS]
    outputs = [x for node in nodes for x in node.get(OUTPUT_KEY, [0] * len(node[UNIT_KEYS[0]]))]
    return UnitCosts(
        tuple(float(x) for x in lists[0]),
        tuple(float(x) for x in lists[1]),
        tuple(int(x) for x in lists[2]),
        tuple(int(x) for x in lists[3]),
        tuple(int(x) for x in lists[4]),
        tuple(int(x) for x in outputs),
    )
