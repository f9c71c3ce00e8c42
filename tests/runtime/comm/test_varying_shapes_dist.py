"""Varying shapes over ``dist``: batches padded each to its own longest sequence train a cut
language model on 2 gloo ranks, with a tag per message and with one tag (posting order, as
over NCCL), bit for bit as in one process, for synchronous and asynchronous methods alike;
and the transport sends each message's sizes first, so a receive posted ahead of time
takes a message of any size, in any order (``support/varying_shapes_worker.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import FOLDER
from support.launch import torchrun
from support.varying_lm import padded_batches, padded_pipeline, weights

pytestmark = pytest.mark.slow
WORKER = FOLDER / "varying_shapes_worker.py"
METHODS = ["1f1b", "zb-h1", "pipeoptim", "xpipe"]


def test_padded_batches_train_on_two_ranks_as_in_one_process(
    tmp_path: Any, one_thread: None
) -> None:
    records = torchrun(WORKER, tmp_path, "--methods", ",".join(METHODS), nproc=2, timeout=900)
    assert records[1]["transport"] == {"each": [True] * 4, "one": [True] * 4}
    for method in METHODS:
        local = padded_pipeline(method)
        result = local.fit(
            padded_batches(4), max_steps=4, eval_data=padded_batches(2, seed=5), eval_every=2
        )
        evaluations = [e.loss for e in result.eval_history]
        assert len(evaluations) >= 2, method
        mine = weights(local)
        for rank, record in enumerate(records):
            for tag, run in record[method].items():
                where = f"{method} on rank {rank} ({tag} tag)"
                assert run["ordered"] == [tag == "one"], where
                assert run["losses"] == result.losses, where  # bit for bit
                assert run["evaluations"] == evaluations, where
                for k, held in run["weights"].items():
                    for name, tensor in held.items():
                        assert torch.equal(tensor, mine[k][name]), f"{where}: {name}"
