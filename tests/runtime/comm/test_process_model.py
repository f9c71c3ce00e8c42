"""The process model apart from the transport class: one value per way of placing ranks in
processes, checked in one place, and the one place that picks the transport class."""

from __future__ import annotations

import pytest
import torch

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.comm.local import LocalTransport
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.runtime.config import check_replicas


def test_the_names_users_give_are_the_values() -> None:
    assert ProcessModel.parse("local") is ProcessModel.ONE_PROCESS
    assert ProcessModel.parse("dist") is ProcessModel.PROCESS_PER_STAGE
    assert ProcessModel.parse(ProcessModel.ONE_PROCESS) is ProcessModel.ONE_PROCESS
    assert ProcessModel.ONE_PROCESS.one_process
    assert not ProcessModel.PROCESS_PER_STAGE.one_process
    assert ProcessModel.ONE_PROCESS == "local"  # a str: configs and traces keep the name


@pytest.mark.parametrize("bad", ["nccl", "", None, 1, "LOCAL"])
def test_an_unknown_process_model_is_refused_naming_the_known_ones(bad: object) -> None:
    with pytest.raises(RuntimeConfigError, match=r"unknown transport .*; use local or dist"):
        ProcessModel.parse(bad)


def test_one_process_gets_a_mailbox_endpoint_per_rank() -> None:
    ends = ProcessModel.ONE_PROCESS.transports(3, 0, torch.device("cpu"), 0, 60)
    assert sorted(ends) == [0, 1, 2]
    assert all(isinstance(t, LocalTransport) for t in ends.values())
    ends[0].send(torch.ones(2), 1, ("act", 1, 0))
    assert ends[1].ready(("act", 1, 0))  # one mailbox between them


def test_replicas_need_one_process_per_stage() -> None:
    with pytest.raises(RuntimeConfigError, match="needs transport='dist'"):
        check_replicas(2, "local")
    assert check_replicas(2, "dist") == 2
