"""The size of a run: P ranks, M micro-batches, N mini-batches, v stages per rank.

Why a module of its own: the generators, the methods' size rules and the work limits all
speak of a shape, and the limits must not import the generators (they import the limits).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shape"]


@dataclass(frozen=True)
class Shape:
    """The size of a run a generator lays out."""

    num_ranks: int
    """Pipeline ranks P (devices). Stage count is ``num_ranks * virtual_stages``."""
    micro_batches: int = 1
    """Micro-batches M per mini-batch; 1 for methods that do not micro-batch."""
    mini_batches: int = 1
    """Mini-batches N in the run (one optimizer update per stage each)."""
    virtual_stages: int = 1
    """Stages per rank (chunks v of interleaved 1F1B); 1 everywhere else."""

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    @property
    def total_micro_batches(self) -> int:
        return self.micro_batches * self.mini_batches
