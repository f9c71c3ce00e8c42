"""A Parameter used on two stages (a tied embedding): exact under synchronous methods, in one
process and in one process per stage, and refused, with the fix, where it cannot be exact."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tied_worker as tw
import torch
from torch import nn

from pipeoptim import Pipeline
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.ties import find_ties

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tied_worker.py")


def single_process(steps: int, micro: int) -> tuple[nn.Module, list[float]]:
    """The reference: the whole model in plain torch, gradients accumulated over micro-batches
    (the tied weight's gradient is the sum of both uses, as autograd gives it)."""
    model = nn.Sequential(*tw.tied_units())
    opt = tw.adamw(list(model.parameters()))
    losses = []
    for x, y in tw.batches(steps):
        total = 0.0
        for xs, ys in zip(x.tensor_split(micro), y.tensor_split(micro), strict=True):
            loss = tw.token_loss(model(xs), ys) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses


def pipeline(method: str, stages: int = 2, micro: int | None = 2, **kwargs: Any) -> Pipeline:
    return Pipeline(
        tw.tied_units(),
        method=method,
        stages=stages,
        micro_batches=micro,
        optimizer=tw.adamw,
        loss_fn=tw.token_loss,
        device="cpu",
        **kwargs,
    )


def test_ties_are_found_by_identity_and_by_view() -> None:
    units = tw.tied_units()
    (tie,) = find_ties(units, [(0, 2), (2, 4)])
    assert tie.stages == (0, 1)
    assert [(s, u, n) for s, u, n in tie.places] == [(0, 0, "table.weight"), (1, 3, "weight")]
    assert find_ties(units, [(0, 4)]) == []  # one stage: plain autograd
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = nn.Parameter(a.weight.data)  # another Parameter, the same storage and view
    assert find_ties([a, b], [(0, 1), (1, 2)])[0].stages == (0, 1)
    c = nn.Linear(3, 2)
    c.weight = nn.Parameter(a.weight.data[:2])  # a slice of it: not one weight per stage
    with pytest.raises(RuntimeConfigError, match="different views of one storage"):
        find_ties([a, c], [(0, 1), (1, 2)])


@pytest.mark.parametrize(
    ("method", "stages", "micro"),
    [("gpipe", 2, 2), ("1f1b", 2, 2), ("1f1b", 3, 4), ("zb-h1", 2, 2), ("zb-v", 2, 4)],
)
def test_tied_weight_under_a_flush_equals_single_process_training(
    method: str, stages: int, micro: int
) -> None:
    steps = 5
    model, losses = single_process(steps, micro)
    pipe = pipeline(method, stages, micro)
    result = pipe.fit(tw.batches(steps), max_steps=steps)
    assert result.losses == pytest.approx(losses, abs=1e-5)
    first, last = pipe.stages[0].module, pipe.stages[max(pipe.stages)].module
    embedding = first.get_parameter("0.table.weight")
    head = last.get_parameter(f"{len(last) - 1}.weight")
    assert embedding is not head  # each stage trains its own copy ...
    assert torch.equal(embedding, head)  # ... and the copies stay one weight
    expected = model.get_parameter("0.table.weight")
    torch.testing.assert_close(embedding, expected, atol=1e-5, rtol=0)
    assert pipe.parts.ties[0].stages == (0, max(pipe.stages))


def test_tied_weight_is_clipped_on_its_own_norm_on_every_member() -> None:
    pipe = pipeline("1f1b", grad_clip=0.05)
    pipe.fit(tw.batches(4), max_steps=4)
    head = pipe.stages[1].module
    assert torch.equal(pipe.stages[0].module.get_parameter("0.table.weight"), head[-1].weight)


@pytest.mark.parametrize("method", ["pipedream", "pipeoptim", "2bw", "xpipe"])
def test_asynchronous_methods_refuse_a_weight_shared_across_stages(method: str) -> None:
    with pytest.raises(RuntimeConfigError) as caught:
        pipeline(method, micro=None)
    text = str(caught.value)
    assert "unit 0 (Embed).table.weight [13, 8]" in text
    assert "stage 0 (unit 0, 'table.weight'), stage 1 (unit 3, 'weight')" in text
    assert "tie_word_embeddings=False" in text and "gpipe" in text


def test_fp16_refuses_a_weight_shared_across_stages() -> None:
    with pytest.raises(RuntimeConfigError, match="fp16 loss scaling"):
        pipeline("gpipe", amp="fp16")


def test_a_tie_inside_one_stage_is_plain_autograd() -> None:
    pipe = pipeline("pipeoptim", stages=1, micro=None)
    assert pipe.parts.ties == [] and pipe.parts.tie_exchange is None
    module = pipe.stages[0].module
    assert module.get_parameter("0.table.weight") is module.get_parameter("3.weight")


def torchrun(
    tmp_path: Path, nproc: int, *args: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    out = tmp_path / "ranks"
    out.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(WORKER),
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})},
    )
    assert launch.returncode == 0, launch.stderr[-3000:]
    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
def test_tied_weight_under_dist_equals_one_process_and_the_copies_stay_equal(
    tmp_path: Path, method: str
) -> None:
    steps = 5
    ranks = torchrun(tmp_path, 2, "--mode", "tied", "--method", method, "--steps", str(steps))
    local = pipeline(method)
    result = local.fit(tw.batches(steps), max_steps=steps)
    assert ranks[1]["losses"] == result.losses  # the same computation: bit for bit
    embedding = ranks[0]["weights"][0]["0.table.weight"]
    head = ranks[1]["weights"][1]["1.weight"]
    assert torch.equal(embedding, head)
    assert torch.equal(embedding, local.stages[0].module.get_parameter("0.table.weight"))
    _, losses = single_process(steps, 2)
    assert result.losses == pytest.approx(losses, abs=1e-5)
