"""The Action IR: one pipeline step of one stage, its text form and per-rank CSV files.

A schedule is plain data, ``dict[rank, list[Action | None]]``, so it prints, parses,
validates and saves. The text form ``"2F13"`` (stage 2, forward, micro-batch 13) and the
CSV layout (one row per rank, an empty cell for an idle step) are the ones
``torch.distributed.pipelining`` reads and writes, so schedules move both ways.

PyTorch's lowered dumps also hold FSDP and data-parallel bookkeeping (``UNSHARD``,
``RESHARD``, ``REDUCE_GRAD``) that has no meaning here: a CSV load drops those cells and
reports it once through ``notes``.

An *overlapped step* (PyTorch's ``OVERLAP_F_B``, written by DualPipeV) holds a forward and
a backward (``B`` or ``I``) of another micro-batch, text ``"(0F7;7B3)OVERLAP_F_B"``. In a
schedule it is the forward, marked ``overlapped``, directly followed by its backward on the
same rank: consumers that run actions one at a time (the runtime's executor, the version
analysis, the simulator) see two actions back to back, which is how PyTorch's
``_PipelineScheduleRuntime`` runs the pair (its sub-actions in order). The text forms
(:func:`format_schedule`, the CSV) write the pair as one cell, and parsing splits it again.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeoptim.errors import ScheduleError
from pipeoptim.jsonfile import read_text
from pipeoptim.plan.limits import max_actions


class Kind(str, enum.Enum):
    """What an action does. The values are the text codes used in action strings."""

    FORWARD = "F"
    BACKWARD = "B"
    """The full backward: input and weight gradients in one action."""
    BACKWARD_INPUT = "I"
    """The input-gradient half of a split backward (zero-bubble schedules)."""
    BACKWARD_WEIGHT = "W"
    """The weight-gradient half, after its own ``I``; it may wait to fill a bubble."""
    UPDATE = "U"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


_COMPUTE = frozenset(
    (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.UPDATE)
)

F = Kind.FORWARD
B = Kind.BACKWARD
U = Kind.UPDATE
SPLIT_BACKWARD = frozenset((Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT))
"""The kinds of a split backward, which only the plan layer (validate, print, CSV) handles."""

# PyTorch's FSDP and data-parallel bookkeeping: a CSV load drops these cells (see DROPPED_NOTE).
_DROPPED_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
# Longest codes first so "SEND_F" is not read as a stage followed by "S...".
_CODES = sorted([k.value for k in Kind] + list(_DROPPED_KINDS), key=len, reverse=True)
_ACTION_RE = re.compile(r"^(\d+)(" + "|".join(_CODES) + r")(\d*)$")
OVERLAP_F_B = "OVERLAP_F_B"
"""PyTorch's name of an overlapped forward+backward step."""
_OVERLAP_RE = re.compile(r"^\(([^;()]*);([^;()]*)\)" + OVERLAP_F_B + "$")
_OVERLAP_BACKWARDS = ("B", "I")

DROPPED_NOTE = (
    "note: {count} UNSHARD/RESHARD/REDUCE_GRAD cells of {source} were dropped (left as idle "
    "steps): they are PyTorch's FSDP and data-parallel bookkeeping; pipeoptim shards no "
    "stage (no FSDP inside a pipeline), and data-parallel gradient averaging happens inside "
    "its update (U)"
)
"""The one note a CSV load reports when it drops PyTorch's FSDP/DP actions."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage.

    ``mb`` is the global micro-batch id (mini-batch ``t`` with ``M`` micro-batches has ids
    ``t*M .. t*M+M-1``). For an update (``U``) it is the mini-batch index ``t`` whose
    accumulated gradient the update applies.
    """

    stage: int
    kind: Kind
    mb: int
    overlapped: bool = field(default=False, compare=False)
    """A forward overlapped with the backward that follows it on its rank (one
    ``OVERLAP_F_B`` step); not part of the action's identity (equality, hashing)."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    def overlapping(self, on: bool = True) -> Action:
        """This action with its ``overlapped`` mark set (or cleared)."""
        return replace(self, overlapped=on)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"2F13"``; the inverse of ``str``. An overlapped step is two actions:
        parse it with :func:`parse_step`."""
        stripped = text.strip()
        match = _ACTION_RE.match(stripped)
        if match is None and OVERLAP_F_B in stripped:
            raise ScheduleError(
                f"{text!r} is an overlapped step of two actions (PyTorch's OVERLAP_F_B); "
                f"parse it with pipeoptim.plan.actions.parse_step, which returns both"
            )
        if match is None:
            raise ScheduleError(
                f"malformed action {text!r}: an action is <stage><kind><micro-batch>, e.g. "
                f"'2F13', with kind one of {', '.join(k.value for k in Kind)}"
            )
        stage, code, mb = match.groups()
        if code in _DROPPED_KINDS:
            raise ScheduleError(
                f"action {text!r} is PyTorch's FSDP/data-parallel bookkeeping ({code}), which "
                f"pipeoptim does not run; load the file with schedule_from_csv or load_csv, "
                f"which drop such cells, or leave it out"
            )
        if mb == "":
            raise ScheduleError(
                f"action {text!r} has no micro-batch number; write it as e.g. '{stage}{code}0'"
            )
        return cls(int(stage), Kind(code), int(mb))


Schedule = dict[int, list[Action | None]]
"""Per-rank action lists; ``None`` is an idle step. Step ``i`` of every rank is one clock tick
(an overlapped step fills two consecutive ticks of its rank: its forward, then its backward)."""


def parse_step(text: str) -> list[Action]:
    """One cell: an action (``"2F13"``) or an overlapped step (``"(0F7;7B3)OVERLAP_F_B"``,
    returned as its forward marked ``overlapped`` then its backward)."""
    match = _OVERLAP_RE.match(text.strip())
    if match is None:
        return [Action.parse(text)]
    forward, backward = (Action.parse(part) for part in match.groups())
    if forward.kind is not Kind.FORWARD or backward.kind.value not in _OVERLAP_BACKWARDS:
        raise ScheduleError(
            f"overlapped step {text!r} must hold a forward then a backward (B or I), as "
            f"'(0F7;7B3)OVERLAP_F_B'; got {forward} then {backward}"
        )
    return [forward.overlapping(), backward]


def format_steps(actions: Sequence[Action | None]) -> list[str]:
    """One rank's cells: ``""`` for an idle step, an overlapped forward and the action after
    it as one ``(F;B)OVERLAP_F_B`` cell (the inverse of :func:`parse_step`)."""
    cells: list[str] = []
    pending: Action | None = None
    for a in actions:
        if pending is not None:
            cells.append(f"({pending};{'' if a is None else a}){OVERLAP_F_B}")
            pending = None
        elif a is not None and a.overlapped:
            pending = a
        else:
            cells.append("" if a is None else str(a))
    if pending is not None:
        cells.append(f"({pending};){OVERLAP_F_B}")
    return cells


def _dropped(cell: str) -> bool:
    """Whether a cell is one of PyTorch's FSDP/DP actions, which a load leaves idle."""
    match = _ACTION_RE.match(cell.strip())
    return match is not None and match.group(2) in _DROPPED_KINDS


def _parse_row(cells: Sequence[str]) -> tuple[list[Action | None], int]:
    """A row's actions (empty and dropped cells idle) and how many cells were dropped."""
    row: list[Action | None] = []
    dropped = 0
    for cell in cells:
        if not cell.strip() or _dropped(cell):
            dropped += bool(cell.strip())
            row.append(None)
        else:
            row += parse_step(cell)
    return row, dropped


def _note_dropped(notes: list[str] | None, count: int, source: str) -> None:
    if notes is not None and count:
        notes.append(DROPPED_NOTE.format(count=count, source=source))


def parse_schedule(
    rows: Mapping[int, Sequence[str]], *, notes: list[str] | None = None
) -> Schedule:
    """Parse per-rank action strings; empty strings become idle steps.

    PyTorch's UNSHARD/RESHARD/REDUCE_GRAD cells become idle steps too; when ``notes`` is
    given, one line saying so is appended to it.
    """
    schedule: Schedule = {}
    dropped = 0
    for rank, cells in rows.items():
        schedule[rank], n = _parse_row(cells)
        dropped += n
    _note_dropped(notes, dropped, "the schedule")
    return schedule


def format_schedule(schedule: Mapping[int, Sequence[Action | None]]) -> dict[int, list[str]]:
    """The inverse of :func:`parse_schedule` (an overlapped step as one cell)."""
    return {rank: format_steps(acts) for rank, acts in schedule.items()}


def schedule_to_csv(
    schedule: Mapping[int, Sequence[Action | None]], *, include_updates: bool = True
) -> str:
    """One CSV row per rank (ranks in order), empty cell = idle.

    PyTorch's pipelining has no update action, so ``include_updates=False`` writes the
    compute-only form it loads; the update steps are then left as idle cells.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in sorted(schedule):
        writer.writerow(
            format_steps(
                [
                    None if a is None or (a.kind is U and not include_updates) else a
                    for a in schedule[rank]
                ]
            )
        )
    return out.getvalue()


def schedule_from_csv(
    text: str, *, source: str = "<csv>", notes: list[str] | None = None
) -> Schedule:
    """Parse a CSV written by :func:`schedule_to_csv` or by PyTorch's ``_dump_csv``.

    Both of PyTorch's formats load: ``compute_only`` (a clock grid, idle cells empty) and
    the lowered ``compute_comms`` (per-rank orders with sends and receives). PyTorch's
    UNSHARD/RESHARD/REDUCE_GRAD cells become idle steps; when ``notes`` is given, one line
    saying so (:data:`DROPPED_NOTE`) is appended to it.
    """
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as err:
        raise ScheduleError(
            f"{source} is not a CSV schedule ({err}); expected one row of actions per rank, "
            f"e.g. '0F0,0B0,0U0'"
        ) from None
    if not rows or all(not any(cell.strip() for cell in row) for row in rows):
        raise ScheduleError(
            f"{source} holds no schedule: expected one CSV row of actions per rank, e.g. "
            f"'0F0,0B0,0U0'"
        )
    schedule: Schedule = {}
    dropped = 0
    for rank, row in enumerate(rows):
        try:
            schedule[rank], n = _parse_row(row)
        except ScheduleError as err:
            raise ScheduleError(f"{source}, row {rank + 1} (rank {rank}): {err}") from None
        dropped += n
    _note_dropped(notes, dropped, source)
    return schedule


def save_csv(schedule: Mapping[int, Sequence[Action | None]], path: str | Path) -> None:
    Path(path).write_text(schedule_to_csv(schedule))


def load_csv(path: str | Path, *, notes: list[str] | None = None) -> Schedule:
    """Read a CSV schedule file; a missing, binary, oversized or malformed file raises
    :class:`ScheduleError` naming the file (and the row for a bad action). ``notes`` as in
    :func:`schedule_from_csv`."""
    p = Path(path)
    remedy = "write one with `pipeoptim schedule --format csv --out FILE`"
    text = read_text(p, what="schedule file", remedy=remedy, error=ScheduleError)
    cells, limit = text.count(",") + text.count("\n") + 1, max_actions()
    if cells > limit:
        raise ScheduleError(
            f"schedule file {str(p)!r} has about {cells:,} cells; the limit is {limit:,} "
            f"(pipeoptim.plan.limits.MAX_GRID_CELLS); load a shorter schedule (fewer "
            f"mini-batches)"
        )
    return schedule_from_csv(text, source=str(p), notes=notes)


def compact(schedule: Mapping[int, Sequence[Action | None]]) -> dict[int, list[Action]]:
    """Drop idle steps: each rank's actions in execution order."""
    return {rank: [a for a in acts if a is not None] for rank, acts in schedule.items()}


def format_grid(
    schedule: Mapping[int, Sequence[Action | None]],
    *,
    mark: tuple[int, int] | None = None,
    max_steps: int | None = None,
) -> str:
    """A fixed-width table, one row per rank; ``mark=(rank, step)`` brackets one cell.

    With ``max_steps`` only a window of steps is shown (around the mark, if any), so
    errors on long schedules stay readable.
    """
    ranks = sorted(schedule)
    length = max((len(schedule[r]) for r in ranks), default=0)
    lo, hi = 0, length
    if max_steps is not None and length > max_steps:
        center = mark[1] if mark is not None else 0
        lo = max(0, min(center - max_steps // 2, length - max_steps))
        hi = lo + max_steps
    cells: dict[tuple[int, int], str] = {}
    for r in ranks:
        for s in range(lo, hi):
            act = schedule[r][s] if s < len(schedule[r]) else None
            prev = schedule[r][s - 1] if 0 < s <= len(schedule[r]) else None
            text = "." if act is None else str(act)
            if act is not None and act.overlapped:  # an overlapped step spans two columns
                text = f"({text};"
            elif act is not None and prev is not None and prev.overlapped:
                text = f"{text})"
            if mark == (r, s):
                text = f"[{text}]"
            cells[(r, s)] = text
    width = max([len(c) for c in cells.values()] + [len(str(hi - 1)), 3])
    label = max(len(f"rank {r}") for r in ranks) if ranks else 4
    header = " " * label + " " + " ".join(str(s).rjust(width) for s in range(lo, hi))
    lines = [header.rstrip()]
    for r in ranks:
        row = " ".join(cells[(r, s)].rjust(width) for s in range(lo, hi))
        lines.append(f"{f'rank {r}'.ljust(label)} {row}".rstrip())
    if lo > 0 or hi < length:
        lines.append(f"(steps {lo}..{hi - 1} of {length})")
    return "\n".join(lines)


def actions_of(schedule: Mapping[int, Iterable[Action | None]]) -> list[tuple[int, int, Action]]:
    """Every action as ``(rank, step, action)``."""
    return [
        (rank, step, act)
        for rank, acts in schedule.items()
        for step, act in enumerate(acts)
        if act is not None
    ]
