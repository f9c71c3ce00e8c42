"""Several tensors between units and stages (as torchgpipe allows): a unit returns a tuple,
which the next unit takes as its positional arguments, within a stage and across a stage
boundary; gradients flow back through the floating-point tensors only.

The synchronous methods are compared with plain single-process torch (the units chained the
same way, the gradient accumulated over the micro-batches); the asynchronous ones, and one
split-backward method, with their own 2-process gloo run, bit for bit. The spawned ranks
import this file for the model (``path.py:net``) and its data (``dataset``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from pipeoptim import Pipeline
from pipeoptim.errors import StageError
from pipeoptim.plan.actions import Action
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.versions import MicroBatchVersions, analyze_versions
from pipeoptim.runtime.comm.dist import DistTransport
from pipeoptim.runtime.comm.local import LocalTransport
from pipeoptim.runtime.comm.transport import MessageKey
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.executor import TensorSpec
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.payload import MAX_PARTS, Payload, split
from pipeoptim.runtime.result import FitResult
from pipeoptim.runtime.stage.chain import UnitChain
from pipeoptim.runtime.stage.stage import Stage
from pipeoptim.workloads.data import Dataset
from pipeoptim.workloads.train import train

HERE = Path(__file__)
EPS = torch.finfo(torch.float32).eps
TOL = 64 * EPS  # float32: the same sums, at most a few roundings apart


class Split(nn.Module):
    """x -> (hidden, a float gate computed from x, a bool mask, an int64 count)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.gate = nn.Linear(6, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        keep = x[:, :1] > -0.5
        return torch.tanh(self.lin(x)), torch.sigmoid(self.gate(x)), keep, (x > 0).sum(1, True)


class Mix(nn.Module):
    """Takes the four, returns four: the gate is used and changed, the masks handed on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(
        self, h: Tensor, gate: Tensor, keep: Tensor, count: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return torch.tanh(self.lin(h * gate)) * keep, gate * 0.9 + 0.05, keep, count


class Merge(nn.Module):
    """Back to one tensor (no weights): the gate reaches the loss through here too."""

    def forward(self, h: Tensor, gate: Tensor, keep: Tensor, count: Tensor) -> Tensor:
        return h + gate * count.float() / 6


def net() -> list[nn.Module]:
    """5 units: tuples cross the boundaries of 2 and 3 stages; the last takes one tensor."""
    return [Split(), Mix(), Mix(), Merge(), nn.Linear(8, 3)]


def samples(n: int = 120) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def dataset() -> Dataset:
    x, y = samples()
    return Dataset("tuples", x[:96], y[:96], x[96:], y[96:], 3)


def batches(batch: int = 16) -> list[tuple[Tensor, Tensor]]:
    x, y = samples(96)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)]


def sgd(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def plain(
    units: list[nn.Module],
    data: Sequence[tuple[Payload, Tensor]],
    steps: int,
    micro: int,
    loss_fn: Callable[..., Tensor] = F.cross_entropy,
) -> list[Tensor]:
    """Single-process torch: the units chained as the stages chain them, the gradient of
    ``micro`` micro-batches accumulated per step (what a flush method computes)."""
    model = UnitChain(*units)
    opt = sgd(list(model.parameters()))
    for step in range(steps):
        x, y = data[step % len(data)]
        for xm, ym in zip(split(x, micro), y.tensor_split(micro), strict=True):
            loss: Tensor = loss_fn(model(xm), ym) / micro
            loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def pipelined(pipe: Pipeline) -> list[Tensor]:
    return [p.detach() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()]


def assert_close(got: list[Tensor], want: list[Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(("method", "stages"), [("gpipe", 2), ("1f1b", 3), ("zb-h1", 3)])
def test_synchronous_methods_equal_plain_training(method: str, stages: int) -> None:
    """Tuples of a float, a bool and an int64 tensor cross every boundary; the weights end
    where single-process torch puts them, the gate's among them: its gradient crosses the
    boundaries back through the float tensor of the tuple."""
    torch.manual_seed(0)
    units = net()
    start = copy.deepcopy(units)
    pipe = Pipeline(units, method, stages=stages, micro_batches=4, optimizer=sgd, device="cpu")
    result = pipe.fit(batches(), max_steps=12)
    assert len(result.losses) == 12
    assert_close(pipelined(pipe), plain(copy.deepcopy(start), batches(), 12, 4))
    split_unit = pipe.stages[0].module[0]
    assert isinstance(split_unit, Split) and isinstance(start[0], Split)
    assert not torch.equal(split_unit.gate.weight, start[0].gate.weight)
    boundaries = pipe._boundaries
    assert boundaries is not None
    assert boundaries[0] == (
        TensorSpec((8,), torch.float32),
        TensorSpec((8,), torch.float32),
        TensorSpec((1,), torch.bool),
        TensorSpec((1,), torch.int64),
    )
    assert isinstance(pipe.stages[0].module, UnitChain)
    assert next(iter(pipe.stages[0].module.state_dict())) == "0.lin.weight"
    metrics = pipe.evaluate(batches()[:2])  # the forward-only schedule carries tuples too
    assert metrics.samples == 32 and metrics.accuracy is not None


def passes(text: str) -> dict[int, MicroBatchVersions]:
    order = {1: [Action.parse(a) for a in text.split()]}
    report = analyze_versions(order, get_method("gpipe").weight_policy, 1)
    return {mb: v for (_, mb), v in report.passes.items()}


class UsesHalf(nn.Module):
    """Takes (h, unused float, mask); hands on (h2, mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h: Tensor, unused: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(h) * mask, mask


def test_stage_backward_of_a_tuple_gives_float_gradients_and_zeros() -> None:
    """A middle stage: the gradient of a tuple input is a tuple, one per float tensor (zeros
    for one the stage does not use), None for the integer mask; the gradient it takes
    covers the float tensors of its output only."""
    torch.manual_seed(0)
    stage = Stage(
        1,
        nn.Sequential(UsesHalf()),
        num_stages=3,
        method=get_method("gpipe"),
        options=StageOptions(OptimizerSpec("sgd", 0.1)),
        micro_batches=1,
    )
    stage.begin_segment(passes("1F0 1B0 1U0"))
    h, unused, mask = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 1, dtype=torch.long)
    out = stage.forward(0, (h, unused, mask))
    assert isinstance(out, tuple) and out[1].dtype == torch.long and not out[0].requires_grad
    g = torch.randn(2, 4)
    grads = stage.backward(0, (g,))  # the float tensors' gradients, as the message has them
    assert isinstance(grads, tuple) and len(grads) == 3
    g_h, g_unused, g_mask = grads
    assert g_mask is None
    assert g_unused is not None and torch.equal(g_unused, torch.zeros(2, 4))
    lin: nn.Linear = stage.module[0].lin  # type: ignore[assignment]
    assert g_h is not None and torch.allclose(g_h, g @ lin.weight)
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, g.T @ h)
    assert stage.memory()["activations"] == 0


class Scores(nn.Module):
    """The last unit returns (logits, an auxiliary float) for the loss to take as is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(h), h.pow(2).mean(1)


def aux_loss(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    logits, aux = out
    return F.cross_entropy(logits, y) + 0.1 * aux.mean()


def test_a_tuple_output_goes_to_the_loss_as_it_is() -> None:
    torch.manual_seed(1)
    units = [*net()[:4], Scores()]
    start = copy.deepcopy(units)
    pipe = Pipeline(
        units, "1f1b", stages=2, micro_batches=2, optimizer=sgd, loss_fn=aux_loss, device="cpu"
    )
    pipe.fit(batches(), max_steps=6)
    assert_close(pipelined(pipe), plain(start, batches(), 6, 2, aux_loss))
    metrics = pipe.evaluate(batches()[:2])
    assert metrics.accuracy is None and metrics.loss > 0  # which tensor scores is the loss's


class PairData(torch.utils.data.Dataset[tuple[tuple[Tensor, Tensor], Tensor]]):
    """Samples ``((features, mask), target)``: a DataLoader collates them to lists."""

    def __init__(self) -> None:
        self.x, self.y = samples(96)
        self.mask = (self.x[:, 2:3] > 0).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        return (self.x[i], self.mask[i]), self.y[i]


class TakesPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) * (1 + mask)


def test_the_data_input_may_be_a_tuple() -> None:
    """Decided: a batch ``((ids, mask), target)`` feeds stage 0's first unit as ``unit(ids,
    mask)``; it is split into micro-batches tensor by tensor."""
    torch.manual_seed(2)
    units: list[nn.Module] = [TakesPair(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]
    start = copy.deepcopy(units)
    loader = DataLoader(PairData(), batch_size=16)
    pipe = Pipeline(units, "gpipe", stages=2, micro_batches=2, optimizer=sgd, device="cpu")
    pipe.fit(loader, max_steps=6)
    data = [((x, m), y) for (x, m), y in loader]
    assert_close(pipelined(pipe), plain(start, data, 6, 2))
    assert pipe.evaluate(loader).samples == 96


def test_bf16_predicted_forward_with_tuples() -> None:
    """PipeOptim's predicted forward (functional_call on the tuple) under bf16 autocast:
    the run trains, and the boundaries carry the autocast dtypes."""
    torch.manual_seed(0)
    pipe = Pipeline(net(), "pipeoptim", stages=3, optimizer=sgd, amp="bf16", device="cpu")
    result = pipe.fit(batches(), max_steps=12)
    assert all(v == v for v in result.losses) and result.losses[-1] < result.losses[0]
    boundaries = pipe._boundaries
    assert boundaries is not None and isinstance(boundaries[0], tuple)
    assert boundaries[0][0].dtype == torch.bfloat16 and boundaries[0][2].dtype == torch.bool


class ReturnsNone(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return x, None


class ReturnsInt(nn.Module):
    def forward(self, h: Tensor, gate: Tensor, keep: Tensor, count: Tensor) -> tuple[Tensor, int]:
        return h, 3


class Unbatched(nn.Module):
    def forward(
        self, h: Tensor, gate: Tensor, keep: Tensor, count: Tensor
    ) -> tuple[Tensor, Tensor]:
        return h, gate[0]  # the gate of the first sample only


def refusal(units: list[nn.Module]) -> str:
    pipe = Pipeline(units, "gpipe", stages=2, micro_batches=2, optimizer=sgd, device="cpu")
    with pytest.raises(StageError) as err:
        pipe.fit(batches(), max_steps=1)
    return str(err.value)


def test_a_tuple_for_a_unit_of_one_argument_names_stage_unit_and_values() -> None:
    message = refusal([Split(), nn.Linear(8, 8), nn.Linear(8, 3)])
    assert message.startswith("stage 0, unit 1 (Linear, expects a last dimension of 8)")
    assert "a tuple of 4 tensors: (2, 8) torch.float32, (2, 8) torch.float32, (2, 1) " in message
    assert "unit 1 takes 1 positional argument but unit 0 returned a tuple of 4 tensors" in message
    assert "return one tensor from unit 0, or make unit 1 take 4 arguments" in message


def test_a_tensor_for_a_unit_of_several_arguments_names_stage_unit_and_values() -> None:
    message = refusal([nn.Linear(6, 8), nn.Tanh(), Mix(), Merge(), nn.Linear(8, 3)])
    assert message.startswith("stage 0, unit 2 (Mix) rejected its input of shape (2, 8) ")
    assert "unit 2 takes 4 positional arguments but unit 1 returned one tensor" in message
    assert "make unit 1 give a tuple of 4 tensors, or unit 2 take one tensor" in message


@pytest.mark.parametrize(
    ("units", "expected"),
    [
        (
            lambda: [ReturnsNone(), nn.Linear(6, 3)],
            "stage 0, unit 0 (ReturnsNone) returned a "
            "tuple whose item 1 is NoneType (None), not a tensor",
        ),
        (
            lambda: [Split(), ReturnsInt(), nn.Linear(8, 3)],
            "stage 0, unit 1 (ReturnsInt) returned a tuple whose item 1 is int (3), not a tensor",
        ),
    ],
)
def test_a_tuple_holding_a_non_tensor_is_refused(
    units: Callable[[], list[nn.Module]], expected: str
) -> None:
    assert refusal(units()).startswith(expected)


def test_a_tensor_without_the_batch_first_at_a_boundary_is_refused() -> None:
    message = refusal([Split(), Unbatched(), nn.Linear(8, 3)])
    assert message.startswith(
        "stage 0, unit 1 (Unbatched) hands the next stage a tuple of 2 tensors: (2, 8) "
        "torch.float32, (8,) torch.float32; its tensor 1, of shape (8,), does not have the "
        "batch dimension first (the dry run's 2 samples)"
    )


def test_transports_carry_tuples_under_distinct_tags() -> None:
    local = LocalTransport.group(2)
    parts = (torch.randn(2, 3), torch.ones(2, 1, dtype=torch.bool))
    local[0].send(parts, 1, ("act", 1, 0))
    got = local[1].recv_parts(("act", 1, 0), 0, (((2, 3), torch.float32), ((2, 1), torch.bool)))
    assert all(torch.equal(a, b) for a, b in zip(got, parts, strict=True))
    dist = DistTransport(0, 4, torch.device("cpu"))
    keys: list[MessageKey] = [
        (kind, stage, mb) for kind in ("act", "grad") for stage in range(4) for mb in range(40)
    ]
    tags = [t for key in keys for t in dist._part_tags(key, MAX_PARTS)]
    assert len(set(tags)) == len(tags)
    assert dist._part_tags(("act", 1, 7), 3)[0] == dist._tag(("act", 1, 7))  # part 0: as one


# -- 2 processes over gloo, bit for bit ----------------------------------------------------


def config(method: str, micro: int, transport: str) -> TrainConfig:
    plan = Plan(
        method,
        2,
        micro_batches=micro,
        optimizer=OptimizerSpec("adam", 0.01),
        model=f"{HERE}:net",
        batch_size=12,
    )
    return TrainConfig(plan, transport=transport, device="cpu", timeout=60, max_steps=10)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "micro"), [("pipedream", 1), ("pipeoptim", 1), ("zb-h1", 2)])
def test_two_gloo_processes_equal_the_local_run_bit_for_bit(
    one_thread: None, method: str, micro: int
) -> None:
    runs: dict[str, FitResult] = {}
    for transport in ("local", "dist"):
        result = train(config(method, micro, transport))
        assert result is not None
        runs[transport] = result
    local, dist = runs["local"], runs["dist"]
    assert dist.losses == local.losses and len(local.losses) == 10
    assert dist.test_accuracy == local.test_accuracy
    assert dist.trace.meta["transport"] == "dist"
