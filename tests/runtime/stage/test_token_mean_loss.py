"""A mini-batch's loss is its token mean (issue 63 item 3): each micro-batch's loss weighs
its counted (not -100) targets, the mini-batch's count travelling with the targets to the
last stage, so every synchronous schedule at any M trains as M = 1 and as a plain torch loop
on the uncut model, on padded batches with a micro-batch of nothing but padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import padded_lm as lm
from support.launch import torchrun

from pipeoptim.runtime.stage.loss import counted_targets, token_share

STEPS = 3
# float32 over a few SGD-momentum steps: the micro-batch sums' rounding, no more
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("method", ["gpipe", "1f1b", "zb-h1"])
def test_padded_batches_train_as_one_micro_batch_and_as_one_device(method: str) -> None:
    batches = lm.padded_batches(STEPS)
    want, want_losses, _ = lm.single_device(batches)
    runs = {}
    for micro in (1, 2, 4) if method == "gpipe" else (2, 4):
        pipe = lm.pipeline(method, micro)
        result = pipe.fit(batches, max_steps=STEPS)
        runs[micro] = lm.weights(pipe)
        for got, expected in zip(runs[micro], want, strict=True):
            torch.testing.assert_close(got, expected, **TOLERANCE)
        # the logged loss is the mini-batch's token mean too
        assert result.losses == pytest.approx(want_losses, rel=1e-5)
    first = min(runs)
    for ws in runs.values():
        for got, expected in zip(ws, runs[first], strict=True):
            torch.testing.assert_close(got, expected, **TOLERANCE)


def test_a_micro_batch_of_padding_does_not_change_the_step() -> None:
    """Samples 2 and 3 (micro-batch 1 of 4) are all padding: dropping them from the batch
    gives the same step."""
    batches = lm.padded_batches(1)
    x, y = batches[0]
    assert bool((y[2:4] == lm.IGNORE).all())
    pipe = lm.pipeline("gpipe", 4)
    pipe.fit(batches, max_steps=1)
    keep = torch.tensor([0, 1, 4, 5, 6, 7])
    want, _, _ = lm.single_device([(x[keep], y[keep])])
    for got, expected in zip(lm.weights(pipe), want, strict=True):
        torch.testing.assert_close(got, expected, **TOLERANCE)


def test_without_ignored_targets_the_share_is_the_mean_of_means_bit_for_bit() -> None:
    """Classification, or nothing padded: 1/M exactly as before (loss / M)."""
    loss = torch.tensor(0.7312345)
    target = torch.tensor([1, 2, 0])
    for replicas in (1, 2):
        counted = counted_targets(torch.zeros(3 * 3 * replicas, dtype=torch.long))
        assert torch.equal(token_share(loss, target, 3, counted, replicas), loss / 3)
    floats = torch.randn(3)
    assert torch.equal(token_share(loss, floats, 3, counted_targets(floats)), loss / 3)


def test_an_all_padded_mini_batch_gives_zero_not_nan() -> None:
    target = torch.full((2, 4), lm.IGNORE)
    share = token_share(torch.tensor(0.0), target, 2, counted_targets(target))
    assert share.item() == 0.0


@pytest.mark.slow
def test_dist_equals_local_bit_for_bit_on_padded_batches(tmp_path: Path) -> None:
    """The count travels inside the target message (dist) as it does in one process."""
    args = ["--method", "1f1b", "--micro-batches", "4", "--steps", str(STEPS)]
    ranks = torchrun(Path(lm.__file__), tmp_path, *args, nproc=2)
    local = lm.pipeline("1f1b", 4)
    result = local.fit(lm.padded_batches(STEPS), max_steps=STEPS)
    last = max(range(2), key=lambda r: bool(ranks[r]["losses"]))
    assert ranks[last]["losses"] == result.losses
    for rank in ranks:
        for k, state in rank["weights"].items():
            for name, tensor in state.items():
                assert torch.equal(tensor, local.stages[k].module.state_dict()[name]), (k, name)


def test_a_count_known_on_the_host_weighs_as_the_device_s() -> None:
    """In one process the count is read where the batch was (an int): the same shares."""
    loss = torch.tensor(0.7312345)
    target = torch.tensor([[1, lm.IGNORE], [2, 0]])
    for total in (8, 5, 0):  # nothing ignored, some, all
        on_device = token_share(loss, target, 2, torch.tensor([total]))
        on_host = token_share(loss, target, 2, total)
        torch.testing.assert_close(on_host, on_device, rtol=1e-7, atol=0)
    assert torch.equal(token_share(loss, target, 2, 8), loss / 2)
