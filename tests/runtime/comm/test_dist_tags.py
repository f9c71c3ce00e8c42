"""The tags of the tagged gloo mode: unique among a pair's messages in flight, also where a
rank holds several stages (interleaved, V shapes)."""

from __future__ import annotations

import itertools

import torch

from pipeoptim.runtime.comm.dist import DistTransport


def test_two_stages_per_rank_give_every_message_of_a_window_its_own_tag() -> None:
    # 2 ranks, 4 stages: counted in ranks, (act, stage 3, mb 0) and (act, stage 1, mb 1)
    # would share a tag, and gloo could hand one to the other's receive.
    transport = DistTransport(0, 2, torch.device("cpu"), tag_stages=4)
    keys = [
        (kind, stage, mb)
        for kind, stage, mb in itertools.product(("act", "grad"), range(4), range(8))
    ]
    tags = [transport._tag(key) for key in keys]
    assert len(set(tags)) == len(keys)


def test_the_tags_count_ranks_as_stages_when_told_nothing_else() -> None:
    transport = DistTransport(0, 2, torch.device("cpu"))
    assert transport._tag(("act", 1, 0)) != transport._tag(("act", 0, 1))
