"""``torch.compile`` of a stage's units: each unit compiled once, in place, at stage build.

Why per unit and in place: a stage runs its units one by one where it splits a backward or
recomputes some of them (``split_backward.py``, ``recompute.py``), so the unit is what must be
compiled, not the stage; compiled in place as ``nn.Module.compile`` does (the unit's call
goes through the compiled function, no wrapper module), parameter names, ``state_dict`` keys
(checkpoints, export) and tied weights stay those of the uncompiled unit.

Why it compiles once per kind of call, not once per weight version: a forward on a stashed
version or a prediction Ŵ puts other tensors of the same shape, dtype and device in the unit's
parameter slots (``swap.py``). Dynamo (``inline_inbuilt_nn_modules``, on by default since torch
2.5) takes a module's parameters as graph inputs, not as constants it guards on, so one
compiled graph runs on every version. It does guard on their type and on grad mode: a unit
compiles once for its parameters, once more where a method runs it on aliases of a version
(plain tensors, not ``nn.Parameter``), once more for evaluation (no grad), and then never
again, however many versions follow (``tests/runtime/stage/test_compile.py`` counts it).

What changes under compile: the linear layers' gradients are no longer added inside their
products (``accumulate_in_product.py``: a torch function mode the compiled graph would not
see); a compiled unit's backward is one function, which may compute the unit's weight
gradients in a split backward's input half as well as in its weight half (the same values;
the extra work is not measured here). Inductor's random operations draw from a generator
of their own (seeded from the stage's stream: reproducible, but not eager's numbers,
unless ``torch._inductor.config.fallback_random``). Under autocast, a forward on another weight
version than the live one saves its own casts of that version inside the compiled graph,
where the stage cannot re-cast them: where the backward is to read other weights than the
forward (a predicting method), that is refused (:func:`compile_refusal`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from pipeoptim.errors import RuntimeConfigError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "COMPILE_MODES",
    "CUDA_GRAPH_MODES",
    "check_compile",
    "compile_keywords",
    "compile_refusal",
    "compile_units",
]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""Inductor's modes: a ``compile`` string among them compiles with inductor in that mode."""

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes that record CUDA graphs, which hold the addresses of the weights they read."""


def check_compile(value: object) -> None:
    """Refuse a ``compile`` option that is neither a flag, a mode nor a backend's name."""
    if isinstance(value, bool):
        return
    if not isinstance(value, str):
        raise RuntimeConfigError(
            f"compile must be True, False, an inductor mode or a torch.compile backend's name "
            f"(got {type(value).__name__}); e.g. compile=True or compile='aot_eager'"
        )
    if value in COMPILE_MODES:
        return
    import torch._dynamo  # the backends' registry: only where a name is to be checked

    backends = torch._dynamo.list_backends(exclude_tags=())
    if value not in backends:
        raise RuntimeConfigError(
            f"unknown compile {value!r}: not an inductor mode ({', '.join(COMPILE_MODES)}) nor a "
            f"registered torch.compile backend ({', '.join(sorted(backends))}); e.g. "
            f"compile=True (inductor) or compile='aot_eager'"
        )


def compile_keywords(value: bool | str) -> dict[str, Any] | None:
    """``torch.compile``'s keywords for the option's ``value`` (None: no compile)."""
    if value is False:
        return None
    if value is True:
        return {}
    if value in COMPILE_MODES:
        return {"mode": value}
    return {"backend": value}


def compile_refusal(
    value: bool | str, *, method: str, one_version: bool, predicts: bool, amp: str | None
) -> str | None:
    """Why ``compile=value`` cannot run ``method`` (whose stages keep one weight version, or
    not; that predicts weights, or not) under ``amp``; None where it can."""
    if value is False or one_version:
        return None
    if value in CUDA_GRAPH_MODES:
        return (
            f"compile={value!r} records CUDA graphs, which hold the addresses of the weights "
            f"they read, and {method} runs forwards on other weight versions (stashed or "
            f"predicted) in other storage: use compile='max-autotune-no-cudagraphs' or "
            f"compile=True, or a synchronous method (1f1b, gpipe, zb-h1)"
        )
    if amp is not None and predicts:
        return (
            f"compile with amp={amp!r} under {method}: a predicted forward saves its casts of "
            f"the predicted weights inside the compiled graph, where the stage cannot re-cast "
            f"them from the live weights its backward is to read; drop amp or compile, or use "
            f"a method that does not predict (pipedream, 2bw, 1f1b)"
        )
    return None


def compile_units(module: nn.Module, value: bool | str, *, retains_graph: bool = False) -> int:
    """Compile each unit of ``module`` (a stage's chain; another module as one unit) in
    place with ``compile=value``; the number of units compiled. ``retains_graph``: the
    stage walks a forward's graph twice (a split backward's I and W), which a compiled
    backward allows only where it was compiled without donated buffers (torch reuses those
    in its first walk; the walks turn them off too: ``split_backward.py``)."""
    keywords = compile_keywords(value)
    if keywords is None:
        return 0
    import torch  # only once a stage is built (the options stay torch-free)

    units = list(module) if isinstance(module, torch.nn.Sequential) else [module]
    for unit in units:
        # what ``unit.compile()`` sets, with a frame of pipeoptim's on top: dynamo skips a
        # frame of torch.nn's own code (a bare nn.Linear unit would run uncompiled), but
        # inlines it from a frame it traces
        compiled = torch.compile(_caller(unit), **keywords)
        unit._compiled_call_impl = _keeping_buffers(compiled) if retains_graph else compiled
    return len(units)


def _caller(unit: nn.Module) -> Callable[..., Any]:
    """``unit``'s call, as a function whose code is its own: dynamo keeps its compiled
    graphs (and counts its recompiles against a limit) per code object, so one code shared
    by a stage's units would recompile at every change of unit and hit that limit."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return unit._call_impl(*args, **kwargs)  # type: ignore[no-untyped-call]

    own = types.FunctionType(
        call.__code__.replace(), call.__globals__, call.__name__, None, call.__closure__
    )
    return cast(Callable[..., Any], own)


def _keeping_buffers(compiled: Callable[..., Any]) -> Callable[..., Any]:
    import torch._functorch.config as aot_config

    def run(*args: Any, **kwargs: Any) -> Any:
        with aot_config.patch(donated_buffer=False):
            return compiled(*args, **kwargs)

    return run
