"""Every method over NCCL's matching rule, checked on CPU: gloo with one tag for every
message matches a pair's messages in posting order per direction, as NCCL does, so a run in
that mode finishes only if each receiver posts its receives in the order the sender posts
its sends (``RankMessages.agreed_order``); it must then compute bit for bit what the
default run (a tag per message) does.

Each launch runs many methods in one process group (``support/one_tag_worker.py``): every
registered method, so a method added later is covered without a line here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import FOLDER, one_tag_worker
from support import tied_worker as tw
from support.launch import tied_torchrun, torchrun

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods.registry import get_method
from pipeoptim.runtime.model.ties import Tie, refuse_mixed_streams

pytestmark = pytest.mark.slow
WORKER = FOLDER / "one_tag_worker.py"


def assert_one_tag_equals_tagged(
    records: list[dict[str, Any]], methods: list[str], evaluations: int = 2
) -> None:
    for rank, record in enumerate(records):
        assert sorted(record) == sorted(methods)
        for method, runs in record.items():
            tagged, one = runs["each"], runs["one"]
            where = f"{method} on rank {rank}"
            assert one["ordered"] == [True] and tagged["ordered"] == [False], where
            assert one["step"] == tagged["step"], where
            assert one["losses"] == tagged["losses"], where
            assert one["evaluations"] == tagged["evaluations"], where
            assert len(tagged["evaluations"]) >= evaluations, where
            assert one["weights"].keys() == tagged["weights"].keys(), where
            for k, weights in tagged["weights"].items():
                for name, tensor in weights.items():
                    assert torch.equal(one["weights"][k][name], tensor), f"{where}: {name}"
    assert any(record[m]["each"]["losses"] for record in records for m in methods)


def test_every_method_runs_with_one_tag_on_two_ranks_bit_for_bit(tmp_path: Any) -> None:
    # every message over gloo (no shared-memory ring): the matching rule is gloo's alone
    records = torchrun(WORKER, tmp_path, nproc=2, env={"PIPEOPTIM_SHARED_MEMORY": "0"}, timeout=900)
    # evaluations between segments
    assert_one_tag_equals_tagged(records, one_tag_worker.toy_methods())


def test_the_shared_memory_fallback_and_tuples_keep_the_order(tmp_path: Any) -> None:
    # rings of 256 bytes: a 4-sample hidden state (128 bytes) goes through a ring, an
    # 8-sample one (every evaluation batch) over gloo, so one channel mixes both paths
    methods = ["interleaved-1f1b", "zb-v", "pipedream", "1f1b"]
    records = torchrun(
        WORKER,
        tmp_path,
        "--methods",
        ",".join(methods),
        "--model",
        "tuples",
        nproc=2,
        env={"PIPEOPTIM_SHARED_MEMORY": "0.0003"},
        timeout=600,
    )
    assert_one_tag_equals_tagged(records, methods)


def test_two_stages_per_rank_with_one_tag_on_four_ranks(tmp_path: Any) -> None:
    methods = ["interleaved-1f1b", "zb-v", "pipeoptim"]
    records = torchrun(
        WORKER,
        tmp_path,
        "--methods",
        ",".join(methods),
        nproc=4,
        env={"PIPEOPTIM_SHARED_MEMORY": "0"},
        timeout=600,
    )
    assert_one_tag_equals_tagged(records, methods)


def test_a_stop_inside_a_segment_cuts_alike_with_one_tag(tmp_path: Any) -> None:
    # a receive posted for a send the stop cancels would take the next message of its
    # channel: neither the deciding rank nor the others post past a stop's horizon
    methods = ["interleaved-1f1b", "zb-v", "pipeoptim", "2bw"]
    records = torchrun(
        WORKER,
        tmp_path,
        "--methods",
        ",".join(methods),
        "--stop-at",
        "2",
        nproc=2,
        env={"PIPEOPTIM_SHARED_MEMORY": "0"},
        timeout=600,
    )
    assert_one_tag_equals_tagged(records, methods, evaluations=1)
    # stopped inside the segment of 8 steps (after step 2's horizon: later where a method
    # runs ahead)
    assert all(3 <= runs["one"]["step"] < 8 for record in records for runs in record.values())


def test_a_weight_tied_across_two_stages_per_rank_with_one_tag(tmp_path: Any) -> None:
    # interleaved on 2 ranks: the embedding on stage 0 (rank 0), its output projection on
    # stage 3 (rank 1), so the shared gradients cross the pair that carries both legs
    steps, micro = 4, 2
    args = ["--mode", "tied", "--method", "interleaved-1f1b", "--steps", str(steps)]
    ranks = tied_torchrun(tmp_path, 2, *args, "--micro-batches", str(micro), "--one-tag")
    local = tw.tied_pipeline("interleaved-1f1b", micro=micro)
    result = local.fit(tw.batches(steps), max_steps=steps)
    assert ranks[0]["losses"] == ranks[1]["losses"] == result.losses  # bit for bit
    for rank in ranks:
        for k, weights in rank["weights"].items():
            for name, tensor in weights.items():
                assert torch.equal(tensor, local.stages[k].module.state_dict()[name]), name


def test_ties_that_cross_one_pair_of_ranks_twice_are_refused_where_order_matters() -> None:
    rank_of = {0: 0, 1: 1, 2: 0, 3: 1}  # interleaved, P = 2
    method = get_method("interleaved-1f1b")
    shared = Tie(0, "unit 0 (Embedding).weight", ((0, 0, "w"), (3, 7, "w")), (4,), torch.float32)
    refuse_mixed_streams(method, [shared], rank_of)  # one pair of stages per direction
    four = Tie(
        0, "unit 0 (Linear).weight", tuple((k, 2 * k, "w") for k in range(4)), (4,), torch.float32
    )
    with pytest.raises(RuntimeConfigError, match=r"rank 0 would send rank 1 .* of 4 pairs"):
        refuse_mixed_streams(method, [four], rank_of)
