"""A Parameter used on two stages (a tied embedding): exact under synchronous methods, in one
process and in one process per stage, and refused, with the fix, where it cannot be exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import tied_worker as tw
from support.launch import tied_torchrun as torchrun
from torch import nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.model.ties import find_ties

ROOT = Path(__file__).resolve().parents[3]


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


pipeline = tw.tied_pipeline


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
    [
        ("gpipe", 2, 2),
        ("1f1b", 2, 2),
        ("1f1b", 3, 4),
        ("interleaved-1f1b", 2, 4),
        ("zb-h1", 2, 2),
        ("zb-v", 2, 4),
    ],
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


class LinearTiedHead(nn.Module):
    """The tied head as Hugging Face's decoders have it: ``F.linear`` on the embedding's
    weight (an ``nn.Linear`` whose weight is the table)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (3, 4)])
def test_a_tied_weight_whose_gradient_waits_past_the_send_is_shared_whole(
    stages: int, micro: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every weight in, so the head's gradient is added after its stage's input gradient
    goes upstream (``accumulate_in_product.py``): the share sent to the embedding's stage
    still holds the step's last micro-batch, and the copies stay one weight."""
    from pipeoptim.runtime.stage import accumulate_in_product

    monkeypatch.setattr(accumulate_in_product, "MIN_WEIGHTS", 1)
    steps = 5
    model, losses = single_process(steps, micro)
    units = tw.tied_units()
    units[-1] = LinearTiedHead(units[-1].weight)
    pipe = pipeline("1f1b", stages, micro, units=units)
    last = pipe.stages[max(pipe.stages)]
    assert last._in_product is not None and last._in_product.defer
    result = pipe.fit(tw.batches(steps), max_steps=steps)
    assert result.losses == pytest.approx(losses, abs=1e-5)
    embedding = pipe.stages[0].module.get_parameter("0.table.weight")
    assert torch.equal(embedding, last.module[-1].weight)
    expected = model.get_parameter("0.table.weight")
    torch.testing.assert_close(embedding, expected, atol=1e-5, rtol=0)


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


def head_weight(stages: dict[int, Any]) -> torch.Tensor:
    """The last stage's copy of the tied weight, from its state (the last unit's 'weight')."""
    last = stages[max(stages)]
    key = max(k for k in last if k.endswith(".weight") and k.count(".") == 1)
    return last[key]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "micro"), [("gpipe", 2), ("1f1b", 2), ("zb-v", 4)])
def test_tied_weight_under_dist_equals_one_process_and_the_copies_stay_equal(
    tmp_path: Path, method: str, micro: int
) -> None:
    """zb-v puts stage 0 and the last stage on rank 0: their exchange stays in the process."""
    steps = 5
    args = ["--mode", "tied", "--method", method, "--steps", str(steps)]
    ranks = torchrun(tmp_path, 2, *args, "--micro-batches", str(micro))
    local = pipeline(method, micro=micro)
    result = local.fit(tw.batches(steps), max_steps=steps)
    assert ranks[0]["losses"] == ranks[1]["losses"] == result.losses  # bit for bit
    stages = {k: w for r in ranks for k, w in r["weights"].items()}
    embedding = stages[0]["0.table.weight"]
    assert torch.equal(embedding, head_weight(stages))
    assert torch.equal(embedding, local.stages[0].module.get_parameter("0.table.weight"))
    _, losses = single_process(steps, micro)
    assert result.losses == pytest.approx(losses, abs=1e-5)


@pytest.mark.slow
def test_tied_copies_stay_equal_under_data_parallelism(tmp_path: Path) -> None:
    """Three replicas average each stage's gradients; the shared weight's average must be the
    same on both member stages (a bucket of its own: in a bucket with the others its place,
    and so the rounding, differs between the stages)."""
    args = ["--mode", "tied", "--data-parallel", "3", "--vocab", "3000", "--steps", "8"]
    ranks = torchrun(tmp_path, 6, *args)
    for replica in range(3):
        stages = {
            k: w for r in ranks[replica * 2 : replica * 2 + 2] for k, w in r["weights"].items()
        }
        assert torch.equal(stages[0]["0.table.weight"], head_weight(stages)), replica


def test_two_parameters_over_one_storage_are_one_weight_not_stepped_twice() -> None:
    """Another Parameter object over the same memory is the same tie: each stage gets its own
    copy, so one process trains exactly what the same-Parameter tie trains."""
    same = pipeline("1f1b")
    units = tw.tied_units()
    head = units[3]
    head.weight = nn.Parameter(units[0].table.weight.data)  # new object, same storage
    assert head.weight is not units[0].table.weight
    aliased = pipeline("1f1b", units=units)
    a = same.fit(tw.batches(4), max_steps=4).losses
    b = aliased.fit(tw.batches(4), max_steps=4).losses
    assert a == b
    assert torch.equal(
        same.stages[1].module.get_parameter("1.weight"),
        aliased.stages[1].module.get_parameter("1.weight"),
    )
