"""A stage whose last unit is recomputed lets go of its output once sent (issue 64 item 2).

What would break: the stage keeping its output for every micro-batch in flight (the count
the planner does not make), or letting go of memory a backward still reads (a unit that
saves its own result, ReLU, sigmoid, tanh; the receiver's alias of the message under the
local transport), which changes the weights below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from pipeoptim.plan.memory_factors import method_memory_factors, resolve_factors
from pipeoptim.plan.methods import METHODS
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.stage import recompute

WIDE, BATCH, MICRO = 512, 32, 4


def layers(last: Callable[[], nn.Module]) -> list[nn.Module]:
    """Stage 1 ends in a wide layer and ``last()``; stage 2 is a small head."""
    torch.manual_seed(0)
    return [nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, WIDE), last(), nn.Linear(WIDE, 4)]


def batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
        for _ in range(4)
    ]


def run(name: str, last: Callable[[], nn.Module], units: object) -> tuple[Pipeline, list[Any]]:
    plan = Plan(
        method=name,
        num_stages=3,
        micro_batches=MICRO if METHODS[name].micro_batched else 1,
        boundaries=[(0, 1), (1, 4), (4, 5)],
        optimizer=OptimizerSpec("adam", 0.01),
    )
    pipe = Pipeline(layers(last), plan=plan, recompute=units, memory_every=1)
    result = pipe.fit(batches(), epochs=1)
    weights = [p.detach().clone() for s in pipe.stages.values() for p in s.module.parameters()]
    return pipe, [*result.losses, *weights]


def peak_activations(pipe: Pipeline, rank: int) -> int:
    return max(m.detail.get("activations", 0) for m in pipe.recorder.memory if m.rank == rank)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_a_recomputed_stage_counts_its_inputs_in_flight_and_not_its_output(name: str) -> None:
    pipe, _ = run(name, nn.Identity, {1: "full"})
    slots = resolve_factors(method_memory_factors(name, 3, MICRO), 3)[1][1]
    stage_input = BATCH // MICRO * 64 * 4
    # what the planner books for a stage recomputed in full: its input per slot
    assert peak_activations(pipe, 1) == slots * stage_input


@pytest.mark.parametrize("last", [nn.ReLU, nn.Sigmoid, nn.Identity])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "pipeoptim"])
def test_letting_go_of_the_output_changes_no_bit(
    name: str, last: Callable[[], nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, released = run(name, last, {1: [1, 2]})
    monkeypatch.setattr("pipeoptim.runtime.stage.forward.release_output", lambda *_: None)
    _, kept = run(name, last, {1: [1, 2]})
    _, plain = run(name, last, None)
    for a, b, c in zip(released, kept, plain, strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(c))


def test_the_output_lets_go_of_its_memory_and_keeps_its_graph() -> None:
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(32, 32)
    out = torch.sigmoid(x @ w)  # sigmoid saves its result: a separate reference
    sent = out.detach()
    copy = sent.clone()
    g = torch.randn(8, 32)
    (expected,) = torch.autograd.grad(out, x, g, retain_graph=True)
    recompute.release_output(out, x)
    assert out.untyped_storage().nbytes() == 0 and out.shape == (8, 32)
    assert torch.equal(sent, copy)  # the message (the receiver's alias) keeps its memory
    (got,) = torch.autograd.grad(out, x, g)
    assert torch.equal(got, expected)


def test_an_input_handed_on_is_left_alone() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    mask = torch.ones(4, dtype=torch.bool)
    recompute.release_output((x, mask), (x, mask))
    assert x.untyped_storage().nbytes() == 16 * 4 and mask.untyped_storage().nbytes() == 4
