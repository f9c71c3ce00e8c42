"""Activation recomputation and sharded optimizer state as a plan states them.

Shared by the runtime, the simulator and the planner, torch-free. A plan's ``recompute`` has
one entry per stage:

* ``"none"``: the stage keeps what its forwards save for their backwards;
* ``"full"``: every unit of the stage keeps only its input, and its backward runs its
  forward again first;
* a list of unit selectors: only those units do. A selector is a unit's global index (as a
  number or a string of digits), its name in the model's ``nn.Sequential`` (``"block3"``),
  or its class name (``"Block"``: every unit of that class).

``shard_optimizer`` shards every stage's optimizer state across its D data-parallel
replicas (ZeRO stage 1): each replica keeps and updates 1/D of it, then the updated weights
are gathered. It needs D >= 2.

What a user passes (:func:`resolve_recompute`) is one of the above for every stage, a list
of unit selectors for every stage that holds them, or a mapping stage -> entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeoptim.errors import PipeoptimError, PlanError

__all__ = [
    "RECOMPUTE_MODES",
    "RecomputeEntry",
    "UnitLabels",
    "check_recompute_entries",
    "check_shard_optimizer",
    "parse_recompute_flag",
    "recompute_units",
    "resolve_recompute",
]

RECOMPUTE_MODES = ("none", "full")
"""The named modes; any other entry is a list of unit selectors."""

RecomputeEntry = str | list[str]
"""One stage's recomputation: ``"none"``, ``"full"`` or a list of unit selectors."""

_FIX = (
    "give 'none', 'full', a list of unit names, indices or class names, or a mapping "
    "stage -> one of those"
)


@dataclass(frozen=True)
class UnitLabels:
    """What a unit selector can name: per unit, its name in the model and its class."""

    names: tuple[str, ...]
    """Each unit's name (an ``nn.Sequential`` child's key, else its index as a string)."""
    classes: tuple[str, ...]
    """Each unit's class name."""

    def select(self, selector: str, *, error: type[PipeoptimError] = PlanError) -> list[int]:
        """Global unit indices ``selector`` names, or ``error`` listing what it could be."""
        if selector.isdigit():
            index = int(selector)
            if index < len(self.names):
                return [index]
        found = [i for i, n in enumerate(self.names) if n == selector]
        found = found or [i for i, c in enumerate(self.classes) if c == selector]
        if not found:
            names = ", ".join(dict.fromkeys(self.names[:12]))
            more = "..." if len(self.names) > 12 else ""
            classes = ", ".join(sorted(set(self.classes)))
            raise error(
                f"recompute names unit {selector!r}, which the model does not have; name a "
                f"unit by index 0..{len(self.names) - 1}, by name ({names}{more}) or by "
                f"class ({classes})"
            )
        return found


def _check_entry(entry: object, where: str, error: type[PipeoptimError]) -> RecomputeEntry:
    if isinstance(entry, str):
        if entry not in RECOMPUTE_MODES:
            raise error(
                f"{where}: unknown recompute mode {entry!r}; choose one of "
                f"{', '.join(RECOMPUTE_MODES)} or a list of unit names ({_FIX})"
            )
        return entry
    if (
        isinstance(entry, Sequence)
        and entry
        and all(isinstance(s, str | int) and not isinstance(s, bool) for s in entry)
    ):
        return [str(s) for s in entry]
    raise error(f"{where}: recompute entry {entry!r} is not a mode or a list of units; {_FIX}")


def check_recompute_entries(
    entries: object, num_stages: int, *, error: type[PipeoptimError] = PlanError
) -> list[RecomputeEntry] | None:
    """A plan's ``recompute`` checked: None or one entry per stage."""
    if entries is None:
        return None
    if not isinstance(entries, list) or len(entries) != num_stages:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise error(
            f"a plan's recompute holds one entry per stage ({num_stages}), got {got}; {_FIX}"
        )
    return [_check_entry(e, f"recompute of stage {k}", error) for k, e in enumerate(entries)]


def check_shard_optimizer(
    shard: object,
    data_parallel: int,
    *,
    flag: str = "shard_optimizer",
    error: type[PipeoptimError] = PlanError,
) -> bool:
    """``shard`` as a bool, refused without data parallelism (nothing to shard across)."""
    if not isinstance(shard, bool):
        raise error(f"{flag} must be True or False (got {shard!r})")
    if shard and data_parallel < 2:
        dp = "--data-parallel" if flag.startswith("--") else "data_parallel"
        raise error(
            f"{flag} shards each stage's optimizer state across its data-parallel replicas, "
            f"but {dp} is {data_parallel}; use {dp} 2 or more, or leave {flag} off"
        )
    return shard


def resolve_recompute(
    requested: object,
    boundaries: Sequence[tuple[int, int]],
    labels: UnitLabels,
    *,
    error: type[PipeoptimError] = PlanError,
) -> list[RecomputeEntry] | None:
    """What a user asked for, as a plan's per-stage entries (None: recompute nothing).

    ``requested``: None, a mode for every stage, a list of unit selectors (each stage
    recomputes those of its units), a per-stage list as a plan holds it, or a mapping
    stage -> entry. Every selector is checked against ``labels``."""
    num_stages = len(boundaries)
    entries: list[RecomputeEntry]
    if requested is None:
        return None
    if isinstance(requested, str) and ":" in requested:
        # the command line's spelling: stages:0,1 or units:NAME,NAME
        return resolve_recompute(
            parse_recompute_flag(requested, error=error), boundaries, labels, error=error
        )
    if isinstance(requested, str):
        entries = [_check_entry(requested, "recompute", error)] * num_stages
    elif isinstance(requested, Mapping):
        entries = ["none"] * num_stages
        for stage, entry in requested.items():
            if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
                raise error(f"recompute names stage {stage!r}; stages are 0..{num_stages - 1}")
            entries[stage] = _check_entry(entry, f"recompute of stage {stage}", error)
    elif (
        isinstance(requested, list)
        and len(requested) == num_stages
        and any(isinstance(e, list) or e in RECOMPUTE_MODES for e in requested)
    ):
        entries = check_recompute_entries(requested, num_stages, error=error) or []
    else:
        selectors = _check_entry(requested, "recompute", error)
        assert isinstance(selectors, list)
        chosen = {i for s in selectors for i in labels.select(s, error=error)}
        entries = []
        for start, end in boundaries:
            mine = [labels.names[i] for i in range(start, end) if i in chosen]
            entries.append(mine if mine else "none")
        return entries if any(e != "none" for e in entries) else None
    for k, entry in enumerate(entries):
        if isinstance(entry, list):
            start, end = boundaries[k]
            for s in entry:
                named = labels.select(s, error=error)
                outside = [i for i in named if not start <= i < end]
                if outside and len(outside) == len(named):
                    raise error(
                        f"recompute of stage {k} names unit {s!r} (unit "
                        f"{outside[0]}), which stage {k} does not hold (units {start}.."
                        f"{end - 1}); name it under the stage that holds it"
                    )
    return entries if any(e != "none" for e in entries) else None


def recompute_units(
    entry: RecomputeEntry, start: int, end: int, labels: UnitLabels | None = None
) -> frozenset[int]:
    """The stage-local indices (0 = the stage's first unit) of the units ``entry``
    recomputes, for a stage holding units ``start..end-1``."""
    if entry == "none":
        return frozenset()
    if entry == "full":
        return frozenset(range(end - start))
    assert labels is not None, "unit selectors need the model's labels"
    return frozenset(i - start for s in entry for i in labels.select(s) if start <= i < end)


def parse_recompute_flag(text: str, *, error: type[PipeoptimError] = PlanError) -> object:
    """``--recompute``'s value: ``none``, ``full``, ``stages:0,2`` (those stages in full)
    or ``units:NAME,NAME`` (unit selectors)."""
    if text in RECOMPUTE_MODES:
        return text
    kind, _, rest = text.partition(":")
    items = [s.strip() for s in rest.split(",") if s.strip()]
    if kind == "stages" and items and all(s.isdigit() for s in items):
        return {int(s): "full" for s in items}
    if kind == "units" and items:
        return items
    raise error(
        f"--recompute {text!r} is not understood; give none, full, stages:0,1 (those "
        f"stages in full) or units:NAME,NAME (units by index, name or class)"
    )
