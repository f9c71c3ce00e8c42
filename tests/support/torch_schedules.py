"""Stand-ins for ``torch.distributed.pipelining``'s stages, to build its schedules without a
process group. torch is imported where a stage is built, so a torch-free test may import
this module."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

RANKS = 4
"""Ranks of the schedules built from PyTorch."""
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
"""PyTorch's schedules whose rank r holds stages r and 2P-1-r."""


def mock_stages(name: str, rank: int = 0, ranks: int = RANKS) -> list[Any]:
    """Rank ``rank``'s two stages of ``ranks``: looped (r, r+P) or, for ZBV, the V
    (r, 2P-1-r)."""
    import torch

    second = 2 * ranks - 1 - rank if name in V_SHAPED else rank + ranks
    return [
        SimpleNamespace(
            stage_index=k,
            num_stages=2 * ranks,
            group_rank=rank,
            group_size=ranks,
            submod=torch.nn.Identity(),
        )
        for k in (rank, second)
    ]
