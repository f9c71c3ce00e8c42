"""``Pipeline(compile=...)``: each unit compiled once, in place, and the same training.

What would break each rule: a compile per weight version (the count grows with the steps of
a stashing or predicting method), a unit left uncompiled (a bare ``nn.Linear``, whose frame
dynamo skips), a wrapper that renames the state dict, a split backward whose compiled graph
cannot be walked twice, a recomputation or autocast that changes the losses; and a
combination that cannot run, refused with its rule.

Most tests compile with a counting backend over ``aot_eager`` (the graphs and autograd of a
compile without inductor's C++ build, which a loaded 2-core machine takes minutes over);
one compiles with inductor.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch._inductor.config
from torch import Tensor, nn
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.backends.registry import register_backend

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.pipeline import Pipeline

COMPILED: list[bool] = []
"""Per graph the counting backend compiled: whether grad mode was on (a training forward)."""


@register_backend(name="pipeoptim_test_counting")  # type: ignore[misc]
def counting(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
    COMPILED.append(torch.is_grad_enabled())
    return aot_eager(gm, example_inputs)


class Join(nn.Module):
    """Takes a tuple (the previous unit's two tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(16, 16)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return torch.relu(self.b(x)) + y


class Pair(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, torch.tanh(x)


def units() -> list[nn.Module]:
    """Six units: bare torch.nn layers, a tuple between units, dropout (the RNG stream)."""
    torch.manual_seed(0)
    return [
        nn.Linear(8, 16),
        nn.Dropout(0.1),
        Pair(),
        Join(),
        nn.LayerNorm(16),
        nn.Linear(16, 4),
    ]


def batches(n: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)
    ]


def pipeline(method: str, compile: bool | str, **kw: Any) -> Pipeline:
    shape: dict[str, Any] = {"micro_batches": 4} if method in ("1f1b", "zb-h1") else {}
    return Pipeline(
        units(),
        method=method,
        stages=2,
        optimizer=OptimizerSpec("adam", 0.01),
        compile=compile,
        **{**shape, **kw},
    )


def assert_close_losses(a: list[float], b: list[float], dtype: torch.dtype) -> None:
    assert len(a) == len(b) > 0
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), **_tolerance(dtype))


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    eps = torch.finfo(dtype).eps
    return {"rtol": 16 * eps, "atol": 16 * eps}


@pytest.mark.parametrize("method", ["1f1b", "zb-h1", "pipeoptim", "pipedream"])
def test_compiled_training_equals_eager_and_compiles_no_more_after_the_first_steps(
    method: str,
) -> None:
    """Stashing (pipedream) and prediction (pipeoptim) run units on other weight versions,
    zb-h1 walks each compiled graph twice (I, then W): the losses stay eager's, and the
    compiles of the first two steps are all there are for three more."""
    eager = pipeline(method, False)
    expected = eager.fit(batches(2), epochs=1).losses + eager.fit(batches(3, 2), epochs=1).losses
    torch._dynamo.reset()
    COMPILED.clear()
    pipe = pipeline(method, "pipeoptim_test_counting")
    losses = pipe.fit(batches(2), epochs=1).losses
    first = len(COMPILED)
    losses += pipe.fit(batches(3, 2), epochs=1).losses
    assert len(COMPILED) == first  # nothing compiled per weight version, nor per step
    assert_close_losses(expected, losses, torch.float32)
    n_units = len(units())
    training = COMPILED.count(True)
    if method in ("1f1b", "zb-h1"):  # every forward on the parameters themselves
        assert training == n_units
    else:  # on the parameters, and on aliases of another version: one more at most
        assert n_units <= training <= 2 * n_units
    assert all(s.compiled_units == len(s.module) for s in pipe.stages.values())


@pytest.mark.parametrize("method", ["zb-h1", "pipeoptim"])
def test_compiled_units_recompute_as_eager_ones(method: str) -> None:
    eager = pipeline(method, False, recompute="full").fit(batches(3), epochs=1).losses
    compiled = pipeline(method, "aot_eager", recompute="full").fit(batches(3), epochs=1).losses
    assert_close_losses(eager, compiled, torch.float32)


@pytest.mark.parametrize("method", ["1f1b", "zb-h1", "pipedream"])
def test_compiled_units_under_bf16_autocast_train_as_eager_ones(method: str) -> None:
    eager = pipeline(method, False, amp="bf16").fit(batches(3), epochs=1).losses
    compiled = pipeline(method, "aot_eager", amp="bf16").fit(batches(3), epochs=1).losses
    assert_close_losses(eager, compiled, torch.bfloat16)


def test_compiling_in_place_keeps_the_state_dict_names() -> None:
    eager = pipeline("1f1b", False)
    pipe = pipeline("1f1b", "aot_eager")
    pipe.fit(batches(1), epochs=1)
    for k, stage in pipe.stages.items():
        assert list(stage.module.state_dict()) == list(eager.stages[k].module.state_dict())
        assert not any("_orig_mod" in name for name, _ in stage.module.named_parameters())


def test_inductor_trains_a_predicting_method_to_eager_losses() -> None:
    """Inductor's kernels, on predicted weights; its dropout draws from torch's generator
    as eager's does only with ``fallback_random`` (else it draws other masks)."""
    eager = pipeline("pipeoptim", False).fit(batches(3), epochs=1).losses
    with torch._inductor.config.patch(fallback_random=True):
        compiled = pipeline("pipeoptim", True).fit(batches(3), epochs=1).losses
    assert_close_losses(eager, compiled, torch.float32)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        (
            {"method": "pipeoptim", "amp": "bf16", "compile": True},
            "compile with amp='bf16' under pipeoptim: a predicted forward saves its casts",
        ),
        (
            {"method": "pipedream", "compile": "reduce-overhead"},
            "compile='reduce-overhead' records CUDA graphs",
        ),
        ({"method": "1f1b", "compile": "no-such-backend"}, "unknown compile 'no-such-backend'"),
        ({"method": "1f1b", "compile": 1}, "compile must be True, False, an inductor mode"),
    ],
)
def test_a_combination_compile_cannot_run_is_refused_with_the_fix(
    keywords: dict[str, Any], message: str
) -> None:
    with pytest.raises(RuntimeConfigError, match="^" + re.escape(message)) as caught:
        Pipeline(units(), stages=2, **keywords)
    assert len(str(caught.value).splitlines()) == 1
