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
from pipeoptim.runtime.comm.local import LocalTransport
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.stage import forward as forward_module
from pipeoptim.runtime.stage import weights as weights_module
from pipeoptim.runtime.stage.rng import draws_random_numbers
from pipeoptim.runtime.stage.stage import Stage

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
        options=StageOptions(OptimizerSpec("sgd", 0.1)),
        micro_batches=m,
    )


def run(stage: Stage, method: str, m: int = 2) -> None:
    stage.begin_segment(passes(method, m))
    for mb in range(2):
        stage.forward(mb, torch.randn(4, 3))
    for mb in range(2):
        stage.backward(mb, torch.randn(4, 2))
    stage.update()


@pytest.mark.parametrize(("method", "aliases"), [("gpipe", 0), ("1f1b", 0), ("2bw", 0)])
def test_forwards_no_update_separates_from_their_backward_run_without_aliases(
    monkeypatch: pytest.MonkeyPatch, method: str, aliases: int
) -> None:
    """Flush methods, and here 2bw too: its first mini-batch reads the live W^(0) and no
    update comes before its backwards (``test_async_fast_path.py`` counts 2bw's aliases
    where versions move: one per weight and version)."""
    calls = []
    for module in (forward_module, weights_module):
        original = module.alias
        monkeypatch.setattr(module, "alias", lambda p, s, o=original: calls.append(1) or o(p, s))
    stage = make(method, nn.Linear(3, 2))
    run(stage, method)
    assert len(calls) == aliases


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

    assert draws_random_numbers(nn.Sequential(nn.Linear(2, 2), Noisy()))
    assert draws_random_numbers(nn.MultiheadAttention(4, 2, dropout=0.1))
    assert not draws_random_numbers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_local_transport_hands_over_without_a_copy() -> None:
    a, b = LocalTransport.group(2)
    sent = torch.randn(3, 4)
    key = ("activation", 0, 1)
    a.send(sent, 1, key)
    got = b.recv(key, 0, (3, 4), torch.float32)
    assert got.data_ptr() == sent.data_ptr()


def test_xpipe_writes_each_prediction_in_one_pass_and_keeps_no_delta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At M >= P every micro-batch of a mini-batch predicts the same distance, so Ŵ is
    written once per update, fused (one addcdiv per weight), with no Δ formed or kept."""
    from pipeoptim.runtime.optim.predict import AdamPredictor, XPipePredictor

    formed: list[int] = []
    fused: list[int] = []
    state_deltas, write_fused = AdamPredictor._state_deltas, AdamPredictor._write_fused

    def counting_deltas(self: AdamPredictor, group: dict[str, Any]) -> list[torch.Tensor | None]:
        formed.append(1)
        return state_deltas(self, group)

    def counting_fused(
        self: AdamPredictor, group: dict[str, Any], eta: float, dest: list[torch.Tensor]
    ) -> bool:
        fused.append(1)
        return write_fused(self, group, eta, dest)

    monkeypatch.setattr(AdamPredictor, "_state_deltas", counting_deltas)
    monkeypatch.setattr(AdamPredictor, "_write_fused", counting_fused)
    method, m = get_method("xpipe"), 4
    shape = method.shape(4, m, 3)  # stage 0 keeps 3 forwards in flight
    order = method.order(shape)[0]
    report = analyze_versions(method.order(shape), method.weight_policy, m)
    torch.manual_seed(0)
    stage = Stage(
        0,
        nn.Sequential(nn.Linear(3, 2)),
        num_stages=4,
        method=method,
        options=StageOptions(OptimizerSpec("adam", 0.01)),
        micro_batches=m,
    )
    assert isinstance(stage.predictor, XPipePredictor)
    stage.begin_segment({mb: v for (k, mb), v in report.passes.items() if k == 0})
    predicting_updates: set[int] = set()  # updates after which some forward predicts
    updates = 0
    for a in order:
        if a.kind.value == "F":
            if report.passes[(0, a.mb)].predicted:
                predicting_updates.add(updates)
            stage.forward(a.mb, torch.randn(4, 3))
            assert stage.predictor.held_tensors() == []  # no Δ between passes either
        elif a.kind.value == "B":
            stage.backward(a.mb, torch.randn(4, 2))
        else:
            stage.update()
            updates += 1
    assert len(predicting_updates) >= 2
    assert sum(report.passes[(0, j)].predicted for j in range(3 * m)) > len(predicting_updates)
    assert len(fused) == len(predicting_updates)  # once per update, not per micro-batch
    assert formed == [] and stage.predictor.kept_computations == 0


def test_xpipe_keeps_delta_from_a_second_prediction_of_one_update() -> None:
    """A first prediction after a step is the fused write; a second one before the next
    step (another distance, as with M < P) forms Δ once and keeps it until that step; both
    equal a fresh predictor's Ŵ (the second to a few float32 eps: another rounding path)."""
    from pipeoptim.runtime.optim.predict import AdamPredictor, XPipePredictor

    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    opt = torch.optim.Adam(layer.parameters(), lr=0.01)
    pred = XPipePredictor(opt)

    def step() -> None:
        layer(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    fresh = AdamPredictor(opt, auto_hooks=False)  # keeps nothing: every write fused
    first = pred.predicted(1)
    assert pred.held_tensors() == [] and pred.kept_computations == 0
    assert all(torch.equal(a, b) for a, b in zip(first, fresh.predicted(1), strict=True))
    second = pred.predicted(2)
    assert pred.kept_computations == 1 and len(pred.held_tensors()) == 2  # weight, bias
    for a, b in zip(second, fresh.predicted(2), strict=True):
        # kept Δ = m·(1/(bc1·(√v̂+ε))), then W − ηΔ; fresh: one addcdiv; about six
        # roundings apart on weights of order one: a few float32 eps
        eps = torch.finfo(b.dtype).eps
        torch.testing.assert_close(a, b, rtol=8 * eps, atol=8 * eps)
    pred.predicted(3)
    assert pred.kept_computations == 1  # the kept Δ serves the rest of the update
    step()  # the step hook drops the kept Δ
    assert pred.held_tensors() == []
    again = pred.predicted(2)
    assert pred.kept_computations == 1 and pred.held_tensors() == []
    assert all(torch.equal(a, b) for a, b in zip(again, fresh.predicted(2), strict=True))
    fresh.close()
    pred.close()


def test_cuda_timing_reuses_its_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two events per action, but created only until the first segment resolves; later
    segments record the same events again (a fake clock stands in for the device)."""
    from pipeoptim.runtime.executor import Recorder
    from pipeoptim.trace import TraceEvent

    created: list[object] = []
    clock = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            created.append(self)
            self.at = 0.0

        def record(self) -> None:
            clock[0] += 1.0
            self.at = clock[0]

        def elapsed_time(self, other: FakeEvent) -> float:
            return (other.at - self.at) * 1e3  # milliseconds, as CUDA reports

    syncs: list[object] = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    recorder = Recorder(torch.device("cuda"), origin=0.0)
    for _segment in range(5):
        for mb in range(10):
            start = recorder.mark()
            end = recorder.mark()
            recorder.add(TraceEvent(0, 0, "F", mb, 0.0, 0.0, 0, 0, 0), start, end)
        recorder.resolve()
    assert len(created) == 1 + 2 * 10  # the base event and the first segment's pairs
    assert len(syncs) == 5  # one device synchronisation per segment, none per action
    # times are perf_counter's base plus whole fake seconds: each rounded once (float64)
    tol = 2 * torch.finfo(torch.float64).eps * recorder.events[-1].end
    assert [e.end - e.start for e in recorder.events] == pytest.approx([1.0] * 50, rel=0, abs=tol)
    # reused events keep their new times: 100 marks after the first, one second apart
    assert recorder.events[-1].end - recorder.events[0].start == pytest.approx(99.0, rel=0, abs=tol)
