"""The files ``pipeoptim plan`` writes: ``--out`` (the plan) and ``--html`` (its partition).

Both ways of planning write them, the stage search (:mod:`pipeoptim.commands.planning`) and
the device search (:mod:`pipeoptim.commands.plan_devices`), which ``planning`` hands a
``--devices`` request to. The writer lives apart from both so that the two import it and
neither imports the other back.
"""

from __future__ import annotations

import argparse

from pipeoptim.commands.common import ResultFiles
from pipeoptim.plan.partition_cost import Partition
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile

__all__ = ["write_plan_files"]


def write_plan_files(
    args: argparse.Namespace,
    plan: Plan,
    partition: Partition,
    profile: Profile,
    cap: int | None,
    summary: str,
) -> ResultFiles:
    """``--out`` (the plan) and ``--html`` (its partition drawn), each reported apart."""
    files = ResultFiles()
    if args.out is not None:
        files.write(args.out, plan.save)
    if args.html is not None:
        from pipeoptim.viz.partition import write_partition_html

        files.write(
            args.html,
            lambda p: write_partition_html(
                p, partition, profile, memory_cap_bytes=cap, summary=summary
            ),
        )
    return files
