"""Varying shapes in one process (``varying_shapes=True``): batches that a collate pads each
to its own longest sequence train a cut language model, the synchronous methods as on one
device; off (the default), the same batches are refused with the fix. Under ``dist``:
runtime/comm/test_varying_shapes_dist.py."""

from __future__ import annotations

import math

import pytest
import torch
from runtime.test_boundary_shape_checks import batches as trimmed_batches
from runtime.test_boundary_shape_checks import trimming_net
from support.varying_lm import padded_batches, padded_pipeline, single_device, tiny_gpt

from pipeoptim import Pipeline
from pipeoptim.errors import RuntimeConfigError, StageError
from pipeoptim.runtime.feed import BatchSpec
from pipeoptim.workloads.gpt import lm_loss


def test_the_padded_batches_differ_in_length() -> None:
    lengths = {x.shape[1] for x, _ in padded_batches(4)}
    assert len(lengths) == 4


@pytest.mark.parametrize("method", ["gpipe", "1f1b", "zb-h1"])
def test_synchronous_methods_train_padded_batches_as_one_device(method: str) -> None:
    pipe = padded_pipeline(method)
    losses = pipe.fit(padded_batches(4), max_steps=4).losses
    expected = single_device(4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))


@pytest.mark.parametrize("method", ["pipeoptim", "xpipe"])
def test_asynchronous_methods_train_and_evaluate_padded_batches(method: str) -> None:
    pipe = padded_pipeline(method)
    result = pipe.fit(
        padded_batches(6), max_steps=6, eval_data=padded_batches(3, seed=5), eval_every=3
    )
    assert len(result.losses) == 6 and all(math.isfinite(v) for v in result.losses)
    assert len(result.eval_history) >= 2
    assert result.eval_history[-1].loss < result.eval_history[0].loss + 0.5


def test_fixed_shapes_refuse_a_batch_of_another_length_with_the_fix() -> None:
    pipe = Pipeline(tiny_gpt(), method="1f1b", stages=2, micro_batches=2, loss_fn=lm_loss)
    with pytest.raises(
        RuntimeConfigError,
        match=r"batch 1 of epoch 0 has inputs of per-sample "
        r"shape \(\d+,\) .* turn varying shapes on: varying_shapes=True",
    ):
        pipe.fit(padded_batches(4), max_steps=4)


def test_fixed_shapes_refuse_a_boundary_that_changes_with_the_fix() -> None:
    pipe = Pipeline(trimming_net(), method="1f1b", stages=2, micro_batches=2, device="cpu")
    with pytest.raises(
        StageError,
        match=r"turn varying shapes on \(Pipeline\(\.\.\., "
        r"varying_shapes=True\)",
    ):
        pipe.fit(trimmed_batches(8), max_steps=8)


def test_a_boundary_that_changes_inside_the_model_trains_with_varying_shapes() -> None:
    # the trimming net drops each micro-batch's trailing padding: refused with fixed shapes
    # (test_boundary_shape_checks.py), carried with varying shapes
    torch.manual_seed(0)
    pipe = Pipeline(
        trimming_net(), method="1f1b", stages=2, micro_batches=2, device="cpu",
        varying_shapes=True,
    )  # fmt: skip
    result = pipe.fit(trimmed_batches(8), max_steps=8)
    assert len(result.losses) == 8 and all(math.isfinite(v) for v in result.losses)
    assert math.isfinite(pipe.evaluate(trimmed_batches(2)).loss)


def test_varying_shapes_still_check_ranks_and_dtypes() -> None:
    ids = torch.zeros(4, 7, dtype=torch.long)
    spec = BatchSpec.of(ids, ids).varying()
    assert spec.input_shape == (-1,) and spec.target_shape == (-1,)
    spec.check(torch.zeros(4, 12, dtype=torch.long), ids[:, :3], "batch 1")  # any lengths
    with pytest.raises(RuntimeConfigError, match="batch 2 has inputs of per-sample shape"):
        spec.check(torch.zeros(4, 7, 2, dtype=torch.long), ids, "batch 2")  # another rank
    with pytest.raises(RuntimeConfigError, match=r"torch\.float32"):
        spec.check(torch.zeros(4, 7), ids, "batch 3")  # another dtype
    pair = BatchSpec.of((ids, ids.bool()), ids).varying()
    pair.check((torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3, dtype=torch.bool)), ids, "x")


def test_varying_shapes_must_be_a_flag() -> None:
    with pytest.raises(RuntimeConfigError, match="varying_shapes must be True or False"):
        Pipeline(tiny_gpt(), method="1f1b", stages=2, loss_fn=lm_loss, varying_shapes="yes")
