"""Size limits: estimate the work of a request before building it, refuse beyond a limit.

A schedule's size is a product of user inputs (P stages, M micro-batches, N mini-batches,
v virtual stages), so one typo (``--mini-batches 1000000000``) asks for billions of actions
and the machine runs out of memory long before anything is printed. Every consumer
estimates the work first, with the closed forms below, and refuses with the estimate, the
limit and the fix before allocating anything. All limits live in this module (the one on
input files beside the code that reads them); docs/limits-and-failures.md has their table:
each limit, its constant, its value and why.

``PIPEOPTIM_MAX_ACTIONS`` in the environment replaces both ``MAX_ACTIONS`` and
``MAX_GRID_CELLS`` (a machine with more memory may raise them; tests lower them).
The runtime's executor keeps only the action order (about 140 B per action), so ``pipeoptim
train`` checks with its own, larger budget through ``max_actions=``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeoptim.errors import WorkLimitError

if TYPE_CHECKING:  # types only: at run time this module imports nothing from pipeoptim.plan
    from pipeoptim.plan.shape import Shape

__all__ = [
    "BYTES_PER_ACTION",
    "BYTES_PER_GRID_CELL",
    "MAX_ACTIONS",
    "MAX_GRID_CELLS",
    "MAX_JITTER",
    "MAX_LAYER_BYTES",
    "MAX_PARTITION_CELLS",
    "MAX_PARTITION_WORK",
    "MAX_PROFILE_BATCH",
    "MAX_PROFILE_REPEATS",
    "MAX_STAGE_BYTES",
    "STAGE_COST",
    "WorkEstimate",
    "check_grid",
    "check_partition_size",
    "check_total",
    "check_work",
    "fit_budget",
    "max_actions",
]

MAX_ACTIONS = 3_000_000
MAX_GRID_CELLS = 3_000_000
MAX_PARTITION_CELLS = 16_000_000
MAX_PARTITION_WORK = 2_000_000_000
MAX_PROFILE_BATCH = 65_536
MAX_PROFILE_REPEATS = 1_000
MAX_JITTER = 3.0
MAX_LAYER_BYTES = 1 << 40
MAX_STAGE_BYTES = 1 << 50
BYTES_PER_ACTION = 1_100
"""Peak memory of one simulated action (measured, SimPy engine with trace and memory)."""
BYTES_PER_GRID_CELL = 600
"""Peak memory of one grid cell of ``pipeoptim schedule`` (measured)."""
STAGE_COST = 3
"""Actions' worth of memory and time one stage costs the simulator on its own."""
ENV_VAR = "PIPEOPTIM_MAX_ACTIONS"


def max_actions() -> int:
    """``MAX_ACTIONS``, or ``$PIPEOPTIM_MAX_ACTIONS`` where set to a positive whole number."""
    text = os.environ.get(ENV_VAR, "").strip().replace("_", "").replace(",", "")
    if not text:
        return MAX_ACTIONS
    if not text.isdigit() or int(text) < 1:
        raise WorkLimitError(
            f"{ENV_VAR} must be a whole number of actions >= 1 (got {os.environ[ENV_VAR]!r}); "
            f"e.g. {ENV_VAR}=10000000, or unset it for the default {MAX_ACTIONS:,}"
        )
    return int(text)


def _size(num_bytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:.0f} B"


@dataclass(frozen=True)
class WorkEstimate:
    """The size of one method's run at one shape, from closed forms (exact for every
    generator in :mod:`pipeoptim.plan.schedules`)."""

    method: str
    """Method name."""
    never_flushes: bool
    """Never flushes (the grid has one warm-up and one drain), else a flush per mini-batch."""
    shape: Shape
    """The resolved sizes."""
    passes: int = 2
    """Compute passes per micro-batch and stage: F and B, or F, I and W (split backward)."""
    in_a_v: bool = False
    """Two stages per rank in a V (zb-v): its grid's length is bounded, not exact."""

    @property
    def per_mini_batch(self) -> int:
        """Compute actions of one mini-batch: every stage runs M forwards, M backwards (or M
        I and M W passes), 1 U."""
        s = self.shape
        return s.num_stages * (self.passes * s.micro_batches + 1)

    @property
    def actions(self) -> int:
        """Compute actions of the run (F, B and U over all stages)."""
        return self.per_mini_batch * self.shape.mini_batches

    @property
    def cost(self) -> int:
        """What the limit counts: the actions plus ``STAGE_COST`` per stage."""
        return self.actions + STAGE_COST * self.shape.num_stages

    def amount(self) -> str:
        """The cost in words: actions, and the stages where they weigh in."""
        stages = self.shape.num_stages
        if 100 * STAGE_COST * stages <= self.actions:
            return f"{self.cost:,} actions"
        return (
            f"{self.cost:,} actions ({self.actions:,} actions, plus {STAGE_COST} for each of "
            f"the {stages:,} stages)"
        )

    @property
    def _fill(self) -> int:
        """Idle steps of a rank per flush: fill and drain of the pipeline (a split backward
        leaves one step per rank, its W's fill the drain; a V at most two per stage)."""
        p = self.shape.num_ranks
        if self.in_a_v:
            return 2 * (2 * p - 1)
        return (p - 1) if self.passes == 3 else 2 * (p - 1)

    @property
    def steps(self) -> int:
        """Clock steps of the grid: per-rank actions plus the pipeline's fill and drain
        (exact, except an upper bound for a V, whose mini-batches overlap)."""
        s = self.shape
        per_rank = s.virtual_stages * (self.passes * s.micro_batches + 1)
        fill = self._fill
        if self.never_flushes:
            return s.mini_batches * per_rank + fill
        return s.mini_batches * (per_rank + fill)

    @property
    def grid_cells(self) -> int:
        """Cells of the clock grid, idle ones included (ranks x steps)."""
        return self.shape.num_ranks * self.steps

    @property
    def grid_per_mini_batch(self) -> int:
        """Grid cells one more mini-batch adds."""
        s = self.shape
        per_rank = s.virtual_stages * (self.passes * s.micro_batches + 1)
        if not self.never_flushes:
            per_rank += self._fill
        return s.num_ranks * per_rank

    def describe(self) -> str:
        s = self.shape
        text = f"{self.method} with P={s.num_ranks:,}, M={s.micro_batches:,}, N={s.mini_batches:,}"
        return text + (f", v={s.virtual_stages:,}" if s.virtual_stages > 1 else "")

    def fix(self, limit: int, per_unit: int | None = None) -> str:
        """What to change so the run fits ``limit``: actions, or grid cells when ``per_unit``
        gives the cells one more mini-batch adds."""
        s = self.shape
        grid = per_unit is not None
        unit = per_unit if per_unit is not None else self.per_mini_batch
        fixed = (self.grid_cells if grid else self.cost) - unit * s.mini_batches
        fits = (limit - fixed) // unit if unit else s.mini_batches
        if fits < 1:
            return (
                f"fewer --stages or --micro-batches: even one mini-batch is "
                f"{fixed + unit:,} {'cells' if grid else 'actions'}"
            )
        if not self.never_flushes:
            return (
                f"fewer --mini-batches (at most {fits:,} fit; every mini-batch is flushed and "
                f"alike, so N = 2 already shows the steady state)"
            )
        shows = 4 * s.num_ranks
        if fits >= shows:
            return (
                f"fewer --mini-batches (at most {fits:,} fit; the steady state repeats, so "
                f"N = 4P = {shows:,} already shows it)"
            )
        return (
            f"fewer --mini-batches (at most {fits:,} fit) and fewer --stages (the steady state "
            f"needs N of about 4P = {shows:,})"
        )


def _env_hint() -> str:
    return f"or set {ENV_VAR} to a larger number on a machine with the memory"


def check_work(
    estimate: WorkEstimate, *, max_actions: int | None = None, what: str = "simulating"
) -> WorkEstimate:
    """Refuse a run of more than ``max_actions`` (default :func:`max_actions`) actions."""
    limit = _limit(max_actions)
    if estimate.cost > limit:
        raise WorkLimitError(
            f"{what} {estimate.describe()} is about {estimate.amount()} (about "
            f"{_size(estimate.cost * BYTES_PER_ACTION)} of memory); the limit is "
            f"{limit:,} actions (about {_size(limit * BYTES_PER_ACTION)}). Fix: "
            f"{estimate.fix(limit)}; {_env_hint()}"
        )
    return estimate


def check_grid(estimate: WorkEstimate, *, max_cells: int | None = None) -> WorkEstimate:
    """Refuse a clock grid of more than ``max_cells`` (default :func:`max_actions`) cells."""
    limit = _limit(max_cells)
    if estimate.grid_cells > limit:
        s = estimate.shape
        raise WorkLimitError(
            f"the schedule grid of {estimate.describe()} is about {estimate.grid_cells:,} "
            f"cells ({s.num_ranks:,} ranks x {estimate.steps:,} steps, about "
            f"{_size(estimate.grid_cells * BYTES_PER_GRID_CELL)} of memory); the limit is "
            f"{limit:,} cells. Fix: {estimate.fix(limit, estimate.grid_per_mini_batch)}; "
            f"{_env_hint()}"
        )
    return estimate


def check_total(
    estimates: Sequence[WorkEstimate], *, max_actions: int | None = None, what: str = "simulating"
) -> None:
    """Refuse several runs kept together (their traces) of more than the limit in all."""
    if len(estimates) == 1:
        check_work(estimates[0], max_actions=max_actions, what=what)
        return
    limit = _limit(max_actions)
    total = sum(e.cost for e in estimates)
    if total > limit:
        parts = ", ".join(f"{e.method} {e.cost:,}" for e in estimates)
        raise WorkLimitError(
            f"{what} {len(estimates)} methods is about {total:,} actions in all ({parts}; "
            f"about {_size(total * BYTES_PER_ACTION)} of memory); the limit is {limit:,} "
            f"actions. Fix: fewer methods, or fewer --mini-batches (the steady state repeats, "
            f"so N = 4P already shows it); {_env_hint()}"
        )


def fit_budget(actions: Sequence[int], max_actions: int | None = None) -> list[bool]:
    """Which of several jobs (their :attr:`WorkEstimate.cost`) to keep so their total stays
    within the limit: the smallest first (the most jobs fit). One flag per job."""
    limit = _limit(max_actions)
    keep = [False] * len(actions)
    used = 0
    for i in sorted(range(len(actions)), key=lambda i: actions[i]):
        if used + actions[i] <= limit:
            keep[i] = True
            used += actions[i]
    return keep


def check_partition_size(num_layers: int, num_stages: int) -> None:
    """Refuse a partition whose dynamic programme is over ``MAX_PARTITION_CELLS`` per stage
    or ``MAX_PARTITION_WORK`` in all."""
    n = max(num_layers - num_stages + 1, 1)
    cells, work = n * n, n * n * num_stages
    if cells > MAX_PARTITION_CELLS or work > MAX_PARTITION_WORK:
        raise WorkLimitError(
            f"partitioning {num_layers:,} layers into {num_stages:,} stages fills "
            f"{num_stages:,} matrices of {n:,} x {n:,} cells ({work:,} in all, about "
            f"{_size(cells * 32)} of memory each); the limits are {MAX_PARTITION_CELLS:,} "
            f"cells per matrix and {MAX_PARTITION_WORK:,} in all. Fix: profile coarser "
            f"layers (group blocks into fewer, larger units) or use more stages"
        )


def _limit(value: int | None) -> int:
    return max_actions() if value is None else value
