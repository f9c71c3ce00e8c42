"""Dicts of tensors between units and stages: a unit may take and return a dict (one
argument, as a tensor is), which crosses a stage boundary as its tensors in the dry run's
key order, a None value as nothing; gradients flow back through the floating-point tensors
only. The data's input may be a dict too, split into micro-batches by its batch dimension.
A value that cannot travel is refused with one line naming the key, the unit and the fix.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim import Pipeline
from pipeoptim.errors import RuntimeConfigError, StageError
from pipeoptim.runtime.boundary import MappingSpec, TensorSpec
from pipeoptim.runtime.payload import Payload, split
from pipeoptim.runtime.stage.chain import UnitChain

EPS = torch.finfo(torch.float32).eps
TOL = 64 * EPS  # float32: the same sums, at most a few roundings apart

Fields = dict[str, Tensor | None]


class Spread(nn.Module):
    """{"x"} -> {"h", a float gate, a bool mask, None, an int64 count}."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.gate = nn.Linear(6, 8)

    def forward(self, batch: Fields) -> Fields:
        x = batch["x"]
        assert x is not None
        return {
            "h": torch.tanh(self.lin(x)),
            "gate": torch.sigmoid(self.gate(x)),
            "keep": x[:, :1] > -0.5,
            "absent": None,
            "count": (x > 0).sum(1, True),
        }


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, f: Fields) -> Fields:
        h, gate, keep, count = f["h"], f["gate"], f["keep"], f["count"]
        assert h is not None and gate is not None and keep is not None and count is not None
        out = torch.tanh(self.lin(h * gate)) * keep + 0.01 * count
        return {**f, "h": out}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, f: Fields) -> Tensor:
        h = f["h"]
        assert h is not None
        out: Tensor = self.lin(h)
        return out


def net() -> list[nn.Module]:
    return [Spread(), Mix(), Mix(), Head()]


def batches() -> list[tuple[Payload, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        ({"x": torch.randn(16, 6, generator=g)}, torch.randint(0, 3, (16,), generator=g))
        for _ in range(3)
    ]


def sgd(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def plain(
    units: list[nn.Module], data: Sequence[tuple[Payload, Tensor]], steps: int, micro: int
) -> list[Tensor]:
    """Single-process torch: the units chained (a dict is the next unit's one argument),
    the gradient of ``micro`` micro-batches accumulated per step."""
    model = UnitChain(*units)
    opt = sgd(list(model.parameters()))
    for step in range(steps):
        x, y = data[step % len(data)]
        for xm, ym in zip(split(x, micro), y.tensor_split(micro), strict=True):
            loss: Tensor = F.cross_entropy(model(xm), ym) / micro
            loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def pipelined(pipe: Pipeline) -> list[Tensor]:
    return [p.detach() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()]


@pytest.mark.parametrize(
    ("method", "stages", "recompute"),
    [("gpipe", 2, None), ("1f1b", 4, None), ("zb-h1", 3, None), ("1f1b", 3, "full")],
)
def test_synchronous_methods_with_dicts_equal_plain_training(
    method: str, stages: int, recompute: str | None
) -> None:
    """A dict of a float, a bool, a None and an int64 tensor crosses every boundary; the
    weights end where single-process torch puts them, the gate's among them: its gradient
    crosses the boundaries back through the dict's float tensors."""
    torch.manual_seed(0)
    units = net()
    start = copy.deepcopy(units)
    extra = {"recompute": recompute} if recompute else {}
    pipe = Pipeline(
        units, method, stages=stages, micro_batches=4, optimizer=sgd, device="cpu", **extra
    )
    result = pipe.fit(batches(), max_steps=6)
    assert len(result.losses) == 6
    got, want = pipelined(pipe), plain(copy.deepcopy(start), batches(), 6, 4)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    first = pipe.stages[0].module[0]
    assert isinstance(first, Spread) and isinstance(start[0], Spread)
    assert not torch.equal(first.gate.weight, start[0].gate.weight)
    boundaries = pipe._boundaries
    assert boundaries is not None
    assert boundaries[0] == MappingSpec(
        ("h", "gate", "keep", "absent", "count"),
        (
            TensorSpec((8,), torch.float32),
            TensorSpec((8,), torch.float32),
            TensorSpec((1,), torch.bool),
            None,
            TensorSpec((1,), torch.int64),
        ),
    )
    metrics = pipe.evaluate(batches()[:2])  # the forward-only schedule carries dicts too
    assert metrics.samples == 32


class Named(nn.Module):
    """Hands on a dict that holds a string (what cannot travel)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, batch: Fields) -> dict[str, object]:
        x = batch["x"]
        assert x is not None
        return {"h": self.lin(x), "gate": torch.ones_like(self.lin(x)), "keep": x[:, :1] > 0,
                "absent": None, "count": x[:, :1].long(), "name": "left"}  # fmt: skip


def test_a_dict_value_that_cannot_travel_is_refused_naming_key_and_unit() -> None:
    pipe = Pipeline([Named(), Mix(), Head()], "gpipe", stages=2, micro_batches=2, device="cpu")
    with pytest.raises(StageError) as caught:
        pipe.fit(batches(), max_steps=1)
    message = str(caught.value)
    assert "stage 0, unit 0 (Named)" in message
    assert "value 'name' is str" in message
    assert "a tensor with the batch first, or None" in message
    assert "\n" not in message


def test_a_data_dict_with_a_list_is_refused_naming_the_key() -> None:
    x, y = batches()[0]
    assert isinstance(x, dict)
    bad = [({**x, "lengths": list(range(16))}, y)]
    pipe = Pipeline(net(), "gpipe", stages=2, micro_batches=2, device="cpu")
    with pytest.raises(RuntimeConfigError, match=r"value 'lengths' is a list.*torch\.as_tensor"):
        pipe.fit(bad, max_steps=1)


class Sometimes(Spread):
    """Hands on None for "absent" on the dry run, a tensor later: the structure changed."""

    calls = 0

    def forward(self, batch: Fields) -> Fields:
        out = super().forward(batch)
        Sometimes.calls += 1
        if Sometimes.calls > 1:
            out["absent"] = out["h"]
        return out


def test_a_dict_whose_none_values_change_after_the_dry_run_is_refused() -> None:
    pipe = Pipeline([Sometimes(), Mix(), Head()], "gpipe", stages=2, micro_batches=2, device="cpu")
    with pytest.raises(StageError, match=r"'absent': \(8,\) torch.float32.*'absent': None"):
        pipe.fit(batches(), max_steps=1)
