"""The per-pass hot path, guarded by counting what it calls (never by timing it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from pipeoptim.plan.actions import Action
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.versions import MicroBatchVersions, analyze_versions
from pipeoptim.runtime import stage as stage_module
from pipeoptim.runtime.stage import Stage
from pipeoptim.runtime.transport import LocalTransport

ORDER = "0F0 0F1 0B0 0B1 0U0"


def passes(method: str, m: int) -> dict[int, MicroBatchVersions]:
    order = {0: [Action.parse(a) for a in ORDER.split()]}
    report = analyze_versions(order, get_method(method).weight_policy, m)
    return {mb: v for (_, mb), v in report.passes.items()}


def make(method: str, module: nn.Module, m: int = 2) -> Stage:
    torch.manual_seed(0)
    return Stage(
        1,
        nn.Sequential(module),
        num_stages=3,
        method=get_method(method),
        optimizer=OptimizerSpec("sgd", 0.1),
        micro_batches=m,
    )


def run(stage: Stage, method: str, m: int = 2) -> None:
    stage.begin_segment(passes(method, m))
    for mb in range(2):
        stage.forward(mb, torch.randn(4, 3))
    for mb in range(2):
        stage.backward(mb, torch.randn(4, 2))
    stage.update()


@pytest.mark.parametrize(("method", "aliases"), [("gpipe", 0), ("1f1b", 0), ("2bw", 2 * 2)])
def test_flush_methods_run_without_an_alias_per_parameter(
    monkeypatch: pytest.MonkeyPatch, method: str, aliases: int
) -> None:
    calls = []
    original = stage_module._alias
    monkeypatch.setattr(stage_module, "_alias", lambda p, s: calls.append(1) or original(p, s))
    stage = make(method, nn.Linear(3, 2))
    run(stage, method)
    assert len(calls) == aliases  # 2 forwards x (weight, bias) where versions can move


def test_activation_bytes_are_counted_once_per_input_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered = []
    original = torch.autograd.graph.saved_tensors_hooks

    @contextmanager
    def counting(pack: Any, unpack: Any) -> Iterator[None]:
        entered.append(1)
        with original(pack, unpack):
            yield

    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", counting)
    stage = make("gpipe", nn.Linear(3, 2))
    run(stage, "gpipe")
    assert len(entered) == 1  # the first forward only; the second reuses the count
    stage.begin_segment(passes("gpipe", 2))
    stage.forward(0, torch.randn(4, 3))
    first = stage.activation_bytes(0)
    stage.forward(1, torch.randn(4, 3))
    assert stage.activation_bytes(1) == first > 0


@pytest.mark.parametrize(
    ("module", "touched"),
    [(nn.Linear(3, 2), False), (nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.1)), True)],
)
def test_rng_state_is_swapped_only_for_modules_that_draw_random_numbers(
    monkeypatch: pytest.MonkeyPatch, module: nn.Module, touched: bool
) -> None:
    stage = make("gpipe", module)
    calls = []
    original = torch.get_rng_state
    monkeypatch.setattr(torch, "get_rng_state", lambda: calls.append(1) or original())
    run(stage, "gpipe")
    assert bool(calls) == touched


def test_user_modules_are_assumed_random() -> None:
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)

    assert stage_module._draws_random_numbers(nn.Sequential(nn.Linear(2, 2), Noisy()))
    assert stage_module._draws_random_numbers(nn.MultiheadAttention(4, 2, dropout=0.1))
    assert not stage_module._draws_random_numbers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_local_transport_hands_over_without_a_copy() -> None:
    a, b = LocalTransport.group(2)
    sent = torch.randn(3, 4)
    key = ("activation", 0, 1)
    a.send(sent, 1, key)
    got = b.recv(key, 0, (3, 4), torch.float32)
    assert got.data_ptr() == sent.data_ptr()
