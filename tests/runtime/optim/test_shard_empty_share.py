"""Sharding (ZeRO-1) where a replica's share holds no parameter of one kind, or none at all.

ZeRO hands each replica one local group per global group, some of them empty; an optimizer
that drops an empty group (MuonWithAdamW did, for the part a replica had nothing of) made
ZeRO's start-up fail. Every family must build over such a share, step, and equal the same
optimizer unsharded, its prediction too; ``pipeoptim train --optimizer muon
--shard-optimizer`` must run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import ROOT, empty_share_worker
from support.launch import torchrun

from pipeoptim.runtime.optim.families import TORCH_FAMILIES
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW

pytestmark = pytest.mark.slow
TOL = 16 * torch.finfo(torch.float32).eps
"""A few float32 ulps: the sharded step and prediction are the unsharded arithmetic."""
FAMILIES = [*TORCH_FAMILIES, "any_torch"]
OWNED = {  # (matrices, vectors) each replica owns, by ZeRO's greedy split by size
    "a replica without a matrix": [(1, 0), (0, 3)],
    "a replica without a vector": [(1, 1), (1, 0)],
    "a replica with nothing (one matrix)": [(1, 0), (0, 0)],
    "a replica with nothing (one vector)": [(0, 1), (0, 0)],
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return torchrun(
        Path(empty_share_worker.__file__), tmp_path_factory.mktemp("empty-share"), nproc=2
    )


def test_the_splits_cover_every_kind_of_empty_share() -> None:
    assert OWNED.keys() == empty_share_worker.SPLITS.keys()
    assert set(empty_share_worker.builders()) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", list(OWNED))
def test_every_family_shards_exactly_over_an_empty_share(
    ranks: list[dict[Any, Any]], family: str, split: str
) -> None:
    for replica, record in enumerate(ranks):
        case = record[(family, split)]
        assert case["error"] is None, case["error"]
        assert (case["matrices"], case["vectors"]) == OWNED[split][replica], case
        assert case["weights_gap"] <= TOL, case
        assert case["predicted_gap"] <= TOL, case


def test_a_muon_group_that_names_its_part_is_kept_even_empty() -> None:
    matrix = torch.nn.Parameter(torch.randn(4, 4))
    opt = MuonWithAdamW([{"params": [matrix], "use_muon": True}, {"params": [], "use_muon": False}])
    assert len(opt.param_groups) == 2 and opt.adamw is not None
    opt = MuonWithAdamW([{"params": [], "use_muon": True}, {"params": [matrix]}])
    assert len(opt.param_groups) == 2 and opt.muon is not None
    assert opt.muon.param_groups[0]["params"] == [] and opt.param_groups[1]["params"] == [matrix]


def test_pipeoptim_train_shards_muon_over_two_replicas() -> None:
    """The built-in model's stages hold a weight matrix and a bias each: ZeRO gives one
    replica the matrix and the other the bias, so each replica's Muon or AdamW part is empty."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pipeoptim", "train", "--quiet", "--device", "cpu"),
            *("--optimizer", "muon", "--shard-optimizer", "--data-parallel", "2"),
            *("--stages", "2", "--max-steps", "3", "--timeout", "60"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
