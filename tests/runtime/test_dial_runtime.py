"""PipeOptim's dial at run time: ``pipeoptim`` with M = 2 micro-batches per update trains,
each forward predicts over the distance the version analysis derives for its micro-batch,
and one process per stage (gloo) gives the weights of the local run bit for bit.

The distances are written out by hand (tests/plan/test_dial_versions.py derives them): at P = 4 and
M = 2, micro-batch j of a mini-batch meets ⌈(P-1-k-j)/2⌉ updates on stage k.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.toy_net import config
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim import Pipeline
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.versions import analyze_order
from pipeoptim.runtime.checkpoint.store import latest_step
from pipeoptim.runtime.stage.prediction import StagePrediction
from pipeoptim.workloads.train import train

P, M, STEPS = 4, 2, 8
DISTANCES = {0: [2, 1], 1: [1, 1], 2: [1, 0], 3: [0, 0]}  # per stage, micro-batch j


def layers() -> list[nn.Module]:
    """One unit of weights per stage (a stage without weights predicts nothing)."""
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(6, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
        nn.Linear(16, 3),
    ]


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS * 8, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_pipeoptim_at_two_micro_batches_predicts_each_ones_distance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    written: dict[int, list[tuple[int, int]]] = {}
    original = StagePrediction._write_prediction

    def spy(self: StagePrediction, s: int) -> list[Tensor]:
        written.setdefault(self.index, []).append((self.weights.current, s))
        return original(self, s)

    monkeypatch.setattr(StagePrediction, "_write_prediction", spy)
    pipe = Pipeline(
        layers(),
        "pipeoptim",
        stages=P,
        micro_batches=M,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        device="cpu",
    )
    result = pipe.fit(loader(), epochs=1)
    assert result.end_step == STEPS and all(torch.isfinite(torch.tensor(result.losses)))
    forwards = [e for e in pipe.trace().events if e.kind == "F"]
    for e in forwards:
        t, j = divmod(e.mb, M)
        if t >= P - 1:  # the steady state: every stage has made its first updates
            assert e.distance == DISTANCES[e.stage][j], (e.stage, e.mb)
    # every predicted forward wrote Ŵ from the live weights of its forward (the analysis's
    # base) over its own distance: what the version analysis says, forward by forward
    spec = get_method("pipeoptim")
    shape = spec.shape(P, M, STEPS)
    report = analyze_order(spec.order_arrays(shape), spec.version_rule, M)
    for k in range(P):
        runs = [report.passes[(k, e.mb)] for e in forwards if e.stage == k]
        want = [(v.forward_base, v.distance) for v in runs if v.distance > 0]
        assert written.get(k, []) == want, k
    assert written[0][-2:] == [(STEPS - 3, 2), (STEPS - 2, 1)]  # the last mini-batch's pair


@pytest.mark.slow
def test_dist_equals_local_bit_for_bit_at_two_micro_batches(
    tmp_path: Path, one_thread: None
) -> None:
    """2 ranks over gloo (each rank's timeout 60 s): stage 0's micro-batches predict over
    1 and 0 updates, stage 1's over none."""
    runs = {}
    for transport in ("local", "dist"):
        cfg = config(
            "pipeoptim",
            2,
            2,
            transport,
            max_steps=10,
            checkpoint_every=10,
            checkpoint_dir=str(tmp_path / transport),
        )
        runs[transport] = train(cfg)
    local, dist = runs["local"], runs["dist"]
    assert local is not None and dist is not None
    assert dist.losses == local.losses
    step = latest_step(tmp_path / "dist")
    assert step is not None and step["step"] == 10
    for k in range(2):
        a = torch.load(tmp_path / "local" / "step-00000010" / f"stage-{k}.pt", weights_only=True)
        b = torch.load(tmp_path / "dist" / "step-00000010" / f"stage-{k}.pt", weights_only=True)
        for name, tensor in a["state"]["module"].items():
            assert torch.equal(tensor, b["state"]["module"][name]), (k, name)
