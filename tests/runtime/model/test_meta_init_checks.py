"""Units built on the meta device: their non-persistent buffers come from the module's own
initialisation, and an ``init_weights`` that leaves a buffer or a parameter unwritten, or returns
a new module, is refused before any work with the unit's name and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipeoptim import Pipeline
from pipeoptim.errors import RuntimeConfigError


class Rotary(nn.Module):
    """A projection followed by a rotary-style scaling whose table is a non-persistent buffer
    (in no state dict), computed in ``__init__``; ``reset_parameters`` recomputes it, the
    torch convention for modules built on the meta device."""

    def __init__(self, dim: int = 8, base: float = 100.0, resettable: bool = True) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", self._table(), persistent=False)
        if not resettable:
            self.reset_parameters = None  # type: ignore[assignment]

    def _table(self) -> Tensor:
        return 1.0 / (self.base ** (torch.arange(self.dim, dtype=torch.float32) / self.dim))

    def reset_parameters(self) -> None:  # type: ignore[no-redef]
        with torch.no_grad():
            self.inv_freq.copy_(self._table().to(self.inv_freq.device))

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = self.proj(x)
        return torch.cos(h * self.inv_freq) + h


class Plain(nn.Module):
    """The same, without ``reset_parameters``: nothing here knows how to recompute it."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        table = 1.0 / (100.0 ** (torch.arange(dim, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", table, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = self.proj(x)
        return h * self.inv_freq


def _units(kind: type[nn.Module]) -> list[nn.Module]:
    torch.manual_seed(3)
    return [kind(), nn.Tanh(), kind(), nn.Linear(8, 8)]


def _meta(kind: type[nn.Module]) -> list[nn.Module]:
    with torch.device("meta"):
        return _units(kind)


def _loader(reference: list[nn.Module]):  # type: ignore[no-untyped-def]
    """The README's init_weights: load the unit's part of a state dict (strictly)."""
    states = [u.state_dict() for u in reference]

    def init(index: int, unit: nn.Module) -> None:
        unit.load_state_dict(states[index])

    return init


def _outputs(pipe: Pipeline, x: Tensor) -> Tensor:
    h = x
    for k in sorted(pipe.stages):
        h = pipe.stages[k].module(h)
    return h


def test_non_persistent_buffers_come_from_the_modules_own_initialisation() -> None:
    reference = _units(Rotary)
    pipe = Pipeline(
        _meta(Rotary), method="gpipe", stages=2, device="cpu", init_weights=_loader(reference)
    )
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = x
        for u in reference:
            want = u(want)
        torch.testing.assert_close(_outputs(pipe, x), want, rtol=0, atol=0)


def test_a_buffer_nothing_initialises_is_refused_with_its_name() -> None:
    with pytest.raises(RuntimeConfigError) as err:
        Pipeline(
            _meta(Plain),
            method="gpipe",
            stages=2,
            device="cpu",
            init_weights=_loader(_units(Plain)),
        )
    text = str(err.value)
    assert "unit 0 (Plain)" in text and "inv_freq" in text, text
    assert "non-persistent" in text and "reset_parameters" in text, text


def test_a_parameter_init_weights_leaves_unwritten_is_refused() -> None:
    def partial(index: int, unit: nn.Module) -> None:
        for m in unit.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight)  # forgets the bias

    with pytest.raises(
        RuntimeConfigError, match=r"unit 0 \(Rotary\).*'proj.bias' is still uninitialised"
    ):
        Pipeline(_meta(Rotary), method="gpipe", stages=2, device="cpu", init_weights=partial)


def test_an_init_weights_that_returns_a_new_module_is_refused() -> None:
    def replace(index: int, unit: nn.Module) -> nn.Module:
        return nn.Linear(8, 8) if isinstance(unit, nn.Linear) else unit

    with pytest.raises(RuntimeConfigError, match=r"init_weights returned a new Linear for unit 3"):
        Pipeline(_meta(Rotary), method="gpipe", stages=2, device="cpu", init_weights=replace)


def test_returning_the_unit_itself_stays_legal() -> None:
    def fill(index: int, unit: nn.Module) -> nn.Module:
        def one(m: nn.Module) -> None:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.3)
                nn.init.zeros_(m.bias)

        return unit.apply(one)  # apply returns the unit: filled in place

    pipe = Pipeline(_meta(Rotary), method="gpipe", stages=2, device="cpu", init_weights=fill)
    assert torch.isfinite(_outputs(pipe, torch.randn(3, 8))).all()
