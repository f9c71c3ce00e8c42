"""The failure board: the record that names the rank that failed first, and why."""

from __future__ import annotations

import torch.distributed as dist

from pipeoptim.runtime.comm.failure_board import FailureBoard


def test_the_first_failure_wins() -> None:
    board = FailureBoard(dist.HashStore())
    board.post(2, "error", "boom")
    board.post(0, "peer", "lost rank 2", suspect=2)
    assert board.read() == {"rank": 2, "kind": "error", "message": "boom"}


def test_an_earlier_non_finite_step_replaces_a_later_one() -> None:
    """Stage 0's weights found non-finite at the checkpoint of step 12 can be posted before
    the last stage's loss of step 8 that caused them: the record ends on step 8, whatever the
    order, and a later step or another kind of failure does not displace it."""
    board = FailureBoard(dist.HashStore())
    board.post(0, "nonfinite", "weights", step=12)
    board.post(1, "nonfinite", "loss", step=8)
    board.post(0, "nonfinite", "weights again", step=16)
    board.post(0, "error", "boom")
    assert board.read() == {"rank": 1, "kind": "nonfinite", "message": "loss", "step": 8}


def test_a_non_finite_value_does_not_displace_another_failure() -> None:
    board = FailureBoard(dist.HashStore())
    board.post(3, "died", "killed by SIGKILL")
    board.post(1, "nonfinite", "loss", step=1)
    assert board.read() == {"rank": 3, "kind": "died", "message": "killed by SIGKILL"}
