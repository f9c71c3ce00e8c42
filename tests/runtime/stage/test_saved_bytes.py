"""The one rule by which the runtime's hook and the profiler count what a forward saves
(``SavedBytes``): each storage's saved span once, weights left out."""

from __future__ import annotations

import torch

from pipeoptim.runtime.stage.saved import SavedBytes


def test_micro_batches_of_one_batch_count_their_own_rows_and_add_up_to_the_batch() -> None:
    batch = torch.randn(8, 16)
    counts = []
    for chunk in batch.chunk(4):
        counter = SavedBytes()
        counter.add(chunk)
        counts.append(counter.total)
    assert counts == [2 * 16 * 4] * 4
    assert sum(counts) == batch.numel() * batch.element_size()


def test_views_of_one_storage_count_its_union_once() -> None:
    qkv = torch.randn(4, 3 * 8)
    counter = SavedBytes()
    for part in qkv.split(8, dim=-1):  # q, k and v: strided slices spanning the rows
        counter.add(part)
    counter.add(qkv.t())  # all of it again
    assert counter.total == qkv.numel() * qkv.element_size()
    rows = torch.randn(10, 4)
    counter = SavedBytes()
    counter.add(rows[:6])
    counter.add(rows[4:8])  # overlaps rows 4 and 5
    assert counter.total == 8 * 4 * 4


def test_weights_are_not_activations() -> None:
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    counter = SavedBytes({weight.untyped_storage().data_ptr()})
    counter.add(weight.t())
    counter.add(x)
    assert counter.total == x.numel() * x.element_size()
