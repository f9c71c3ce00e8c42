"""A stage's split backward (zero-bubble schedules): the input half I, the weight half W.

How: the forward runs the stage's units one by one and keeps the output of each unit that has
weights (:func:`run_units_kept`). The input half (:func:`input_half`) asks autograd for the
gradient of the stage's input and of every such unit output at once
(``torch.autograd.grad(..., retain_graph=True)``): no weight gradient is computed, and the
graph stays. The weight half (:func:`weight_half`) runs, per unit, ``torch.autograd.backward(
unit output, its gradient, inputs=unit weights)``, which walks that unit's part of the graph
only; the caller then drops the graph, so the micro-batch's activations (and the captured
gradients) are held until ``W``. Where the units cannot be told apart (a weight shared by two
units, a container with its own forward or hooks) the stage is one unit: ``W`` then walks the
whole graph for the weights only. No random number is drawn again: both halves reuse the
forward's graph. Synchronous (flush) methods only: no update may come between a forward and
its ``W``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch._functorch.config as aot_config
from torch import Tensor, nn

from pipeoptim.errors import StageError
from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.runtime.payload import Payload, output_problem, parts
from pipeoptim.runtime.stage.chain import UnitChain

__all__ = [
    "KeptUnits",
    "Root",
    "WeightHalf",
    "input_half",
    "reentrant_refusal",
    "run_units_kept",
    "split_refusal",
    "unit_params",
    "weight_half",
]

KeptUnits = list[tuple[Tensor | tuple[Tensor, ...], list[Tensor]]]
"""(unit output, its trainable weights) of each weighted unit, kept by a split forward; for a
unit that returns a tuple, the tensors of it that the unit computed and that need a gradient."""
Root = Tensor | Sequence[Tensor]
WeightHalf = list[tuple[Root, Sequence[Tensor], Root]]
"""What a W runs: (root, weights, gradient of the root) per unit, found by its I; a root of a
tuple is its tensors, with one gradient each."""


def split_refusal(name: str, policy: WeightPolicy, half: str | None = None) -> str:
    """The error for a split backward under a policy that updates between F and W."""
    what = f"an {half} (half of a split backward)" if half else "a split backward (I/W)"
    return (
        f"method {name!r} runs {what} under the {policy.name} weight policy; the runtime "
        f"splits backwards only for synchronous (flush) methods, where no update comes "
        f"between a forward and its W: merge each I and W into one B "
        f"(pipeoptim.plan.passes.merge_backward) for this method"
    )


def unit_params(module: nn.Module, params: Sequence[Tensor]) -> list[list[Tensor]] | None:
    """The trainable weights of each unit of ``module``, where a forward may run its units
    one by one with each unit's weights its own: a plain ``nn.Sequential`` (or the stage's
    :class:`~pipeoptim.runtime.stage.chain.UnitChain`) without hooks, whose every weight belongs
    to exactly one unit. None otherwise."""
    if type(module).forward not in (nn.Sequential.forward, UnitChain.forward):
        return None
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    owner: dict[int, int] = {}
    units: list[list[Tensor]] = []
    for i, unit in enumerate(module._modules.values()):  # as the forward runs them
        if unit is None:
            return None
        mine: list[Tensor] = [p for p in unit.parameters() if p.requires_grad]
        for p in mine:
            if owner.setdefault(id(p), i) != i:
                return None  # shared by two units: one W pass would count it twice
        units.append(mine)
    if set(owner) != {id(p) for p in params}:
        return None
    return units


def reentrant_refusal(out: Any, module: nn.Module, stage: int, first_unit: int) -> str | None:
    """The error for a split backward over a graph that holds a reentrant checkpoint
    (``torch.utils.checkpoint(use_reentrant=True)``: its backward runs a backward of its own,
    which cannot compute input gradients alone), naming the unit; None where there is none.
    Walks the forward's graph once (the stage does it on its first forward of a shape)."""
    roots = [out] if isinstance(out, Tensor) else [t for t in parts(out) if isinstance(t, Tensor)]
    todo = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen: set[int] = set()
    found: list[Any] = []
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "CheckpointFunctionBackward":
            found.append(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    if not found:
        return None
    units = list(module) if isinstance(module, nn.Sequential) else [module]
    named = "a unit"
    for node in found:
        fn = getattr(node, "run_function", None)
        # a module, a bound method, or a functools.partial of one (Hugging Face's layers)
        inner = getattr(fn, "func", fn)
        found_in = [fn, inner, getattr(inner, "__self__", None), *getattr(fn, "args", ())]
        owner = next((m for m in found_in if isinstance(m, nn.Module)), None)
        for i, unit in enumerate(units):
            if owner is not None and any(owner is m for m in unit.modules()):
                named = f"unit {first_unit + i} ({type(unit).__name__})"
                break
        else:
            continue
        break
    return (
        f"stage {stage}: {named} uses reentrant activation checkpointing "
        f"(torch.utils.checkpoint with use_reentrant=True), whose backward cannot be split "
        f"into the input half and the weight half a zero-bubble schedule runs; checkpoint "
        f"with use_reentrant=False (Hugging Face: model.gradient_checkpointing_enable("
        f"gradient_checkpointing_kwargs={{'use_reentrant': False}})), or let pipeoptim "
        f"recompute the unit (recompute=..., --recompute), or use 1f1b"
    )


def run_units_kept(
    module: nn.Sequential,
    x: Payload,
    units: list[list[Tensor]],
    *,
    stage: int,
    failure: Callable[[Payload, Exception], str],
    steps: Sequence[tuple[list[int], Callable[..., Any]]] | None = None,
) -> tuple[Payload, KeptUnits | None]:
    """The units of ``module`` on ``x`` one by one (what the stage's chain does), keeping the
    output of each unit with weights; None in place of the kept outputs where two units hand
    on the same tensor (an in-place unit with weights). A tuple's tensors are kept where the
    unit computed them; one it hands on unchanged is not its output. ``failure`` words a
    unit's error. ``steps`` (where the stage recomputes some units, ``recompute.py``): what
    runs each unit, or each run of recomputed units as one region, whose output is kept
    with the weights of all its units."""
    if steps is None:
        steps = [([i], unit) for i, unit in enumerate(module)]
    kept: KeptUnits | None = []
    seen = {id(t): t.grad_fn for t in parts(x)}
    h: Any = x
    try:
        for covered, step in steps:
            h = step(*h) if isinstance(h, tuple) else step(h)
            params = [p for i in covered for p in units[i]]
            if not params:
                continue
            if isinstance(h, tuple | dict):
                kept = _keep_parts(
                    tuple(h.values() if isinstance(h, dict) else h), params, kept, seen
                )
                continue
            if not isinstance(h, Tensor) or not h.requires_grad:
                continue
            if kept is not None and id(h) not in seen:
                seen[id(h)] = h.grad_fn
                kept.append((h, params))
            else:
                kept = None
    except Exception as err:
        raise StageError(failure(x, err)) from err
    problem = output_problem(h)
    if problem is not None:
        raise StageError(f"stage {stage}: the last unit {problem}")
    out: Payload = h
    return out, kept


def _keep_parts(
    h: tuple[Any, ...], params: list[Tensor], kept: KeptUnits | None, seen: dict[int, Any]
) -> KeptUnits | None:
    """Keep the tensors of a unit's tuple output that it computed (see run_units_kept)."""
    mine: list[Tensor] = []
    for t in h:
        if kept is None or not isinstance(t, Tensor) or not t.requires_grad:
            continue
        if id(t) not in seen:
            seen[id(t)] = t.grad_fn
            mine.append(t)
        elif seen[id(t)] is not t.grad_fn:  # rewritten in place: whose output it is is lost
            return None
    if kept is not None and mine:
        kept.append((tuple(mine), params))
    return kept


def input_half(
    root: Root,
    root_grad: Root | None,
    x_in: Payload,
    units: KeptUnits | None,
    params: Sequence[Tensor],
) -> tuple[Tensor | tuple[Tensor | None, ...] | None, WeightHalf]:
    """The I of one micro-batch: the gradient of its input (None where the input needs
    none; for a tuple input, per tensor, None where one needs none) and what its W is to
    run. ``root`` and ``root_grad``: the output and its gradient, for a tuple the tensors of
    it that need one. The caller runs it under the stage's RNG stream."""
    half: WeightHalf = []
    g_in: Tensor | tuple[Tensor | None, ...] | None = None
    if isinstance(x_in, dict):  # its gradient is that of its parts
        x_in = parts(x_in)
    inputs = [t for t in x_in if t.requires_grad] if isinstance(x_in, tuple) else []
    wants_input = x_in.requires_grad if isinstance(x_in, Tensor) else bool(inputs)
    targets = [x_in] if isinstance(x_in, Tensor) and wants_input else inputs
    n_in = len(targets)
    if units is not None:
        for t, _ in units:
            targets += [t] if isinstance(t, Tensor) else list(t)
    elif params:  # one unit: W walks the whole graph for the weights only
        if isinstance(root, Tensor) and root_grad is None:
            root_grad = torch.ones_like(root)
        assert root_grad is not None
        half.append((root, params, root_grad))
    if targets:
        with _walked_twice():
            found = torch.autograd.grad(
                root, targets, root_grad, retain_graph=True, allow_unused=True
            )
        if isinstance(x_in, Tensor):
            g_in = found[0] if wants_input else None
        elif wants_input:
            given = iter(found[:n_in])
            g_in = tuple(next(given) if t.requires_grad else None for t in x_in)
        found = found[n_in:]
        for t, weights in units or []:
            if isinstance(t, Tensor):
                g, found = found[0], found[1:]
                if g is not None:
                    half.append((t, weights, g))
                continue
            grads, found = found[: len(t)], found[len(t) :]
            pairs = [(p, g) for p, g in zip(t, grads, strict=True) if g is not None]
            if pairs:
                half.append(([p for p, _ in pairs], weights, [g for _, g in pairs]))
    return g_in, half


def weight_half(half: WeightHalf) -> None:
    """The W of one micro-batch: its weight gradients accumulate into ``.grad``."""
    with _walked_twice():
        for root, params, g in half:
            # inputs=: autograd walks only what leads to these weights (this unit).
            torch.autograd.backward(root, g, inputs=params, retain_graph=True)


def _walked_twice() -> AbstractContextManager[None]:
    """The context of a walk of a graph that is walked again: a compiled unit's backward
    (``compiled.py``) refuses a retained graph while torch's donated buffers are on."""
    return cast(AbstractContextManager[None], aot_config.patch(donated_buffer=False))
