"""Which unit of a stage failed, and why, in words a user can act on.

A stage runs its units as one call, and a torch error from deep inside it names neither the
stage nor the unit. On the error path (never on the hot path) the units are run again one
by one, as the stage chains them (a tuple a unit returns is the next unit's positional
arguments), to find the one that fails, and the message names the stage, the unit, the
input's shapes and what a common layer expects, or how many arguments the unit takes where
a tuple met a unit of one argument (or one tensor a unit of several).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pipeoptim.runtime.payload import Payload, describe, output_problem

__all__ = ["describe_failure"]


def _expects(unit: nn.Module) -> str:
    """What a common layer expects of its input, for error messages."""
    if isinstance(unit, nn.Linear):
        return f", expects a last dimension of {unit.in_features}"
    if isinstance(unit, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return f", expects {unit.in_channels} input channels"
    if isinstance(unit, nn.Embedding):
        return f", expects integer ids below {unit.num_embeddings}"
    if isinstance(unit, nn.LayerNorm):
        return f", expects trailing dimensions {tuple(unit.normalized_shape)}"
    return ""


def _shape(x: object) -> str:
    if isinstance(x, tuple | dict):
        return f"({describe(x)})"
    return f"of shape {describe(x)}" if isinstance(x, Tensor) else type(x).__name__


def _arguments(unit: nn.Module) -> tuple[int, float] | None:
    """The fewest and most positional arguments ``unit``'s forward takes (None: unknown)."""
    try:
        params = inspect.signature(unit.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    least = sum(1 for p in positional if p.default is p.empty)
    most = float("inf") if any(p.kind is p.VAR_POSITIONAL for p in params) else len(positional)
    return least, most


def _arity(unit: nn.Module, h: object, index: int) -> str:
    """Why unit ``index`` refused its arguments, where their count does not fit its forward."""
    given = len(h) if isinstance(h, tuple) else 1
    takes = _arguments(unit)
    if takes is None or takes[0] <= given <= takes[1]:
        return ""
    least, most = takes
    count = str(least) if least == most else f"{least} to {most}"
    what = f"a tuple of {given} tensors" if isinstance(h, tuple) else "one tensor"
    source = f"unit {index - 1} returned" if index else "the data's input is"
    if isinstance(h, tuple):
        before = f"return one tensor from unit {index - 1}, or " if index else ""
        fix = f"{before}make unit {index} take {given} arguments"
    else:
        source_ = f"unit {index - 1}" if index else "the data"
        fix = f"make {source_} give a tuple of {count} tensors, or unit {index} take one tensor"
    return (
        f"; unit {index} takes {count} positional argument{'' if most == 1 else 's'} but "
        f"{source} {what} (a tuple a unit returns is the next unit's positional arguments): "
        f"{fix}"
    )


OUT_OF_MEMORY = ("can't allocate memory", "out of memory", "Cannot allocate memory")
"""What the CPU allocator's and CUDA's errors say when memory runs out."""


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the allocator's (CPU or CUDA) out-of-memory error."""
    return isinstance(error, MemoryError | torch.OutOfMemoryError) or any(
        text in str(error) for text in OUT_OF_MEMORY
    )


def out_of_memory_message(
    stage: int, x: Payload, error: BaseException, during: str = "forward"
) -> str:
    """The error of a stage whose pass (``during``: forward, backward) ran out of memory,
    with what frees memory."""
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = "" if during == "forward" else f" in a {during}"
    return (
        f"stage {stage} ran out of memory{where} on an input {_shape(x)}: {cause}; hold less: "
        f"recompute activations in the backward (recompute='full' or a list of units, "
        f"--recompute full), shard the optimizer state across data-parallel replicas "
        f"(shard_optimizer=True, --shard-optimizer), use more stages or smaller "
        f"micro-batches, or let `pipeoptim plan --memory-cap` choose"
    )


def describe_failure(
    units: Sequence[nn.Module], x: Payload, *, stage: int, first_unit: int, error: BaseException
) -> str:
    """Which unit of a stage fails on ``x`` and why: runs the units one by one (no autograd)
    to find it, since a whole-stage call only says that something failed. Running out of
    memory is said as such (running the units again would only fail elsewhere)."""
    if out_of_memory(error):
        return out_of_memory_message(stage, x, error)
    h: object = x
    with torch.no_grad():
        for i, unit in enumerate(units):
            if output_problem(h) is not None:
                break
            name = f"stage {stage}, unit {first_unit + i} ({type(unit).__name__}"
            try:
                h = unit(*h) if isinstance(h, tuple) else unit(h)
            except Exception as err:
                cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
                after = f" (it follows unit {first_unit + i - 1})" if i else ""
                arity = _arity(unit, h, first_unit + i) if isinstance(err, TypeError) else ""
                hint = arity or "; check the data's shape and the layer sizes"
                return (
                    f"{name}{_expects(unit)}) rejected its input {_shape(h)}{after}: "
                    f"{type(err).__name__}: {cause}{hint}"
                )
            problem = output_problem(h)
            if problem is not None:
                return f"{name}) {problem}"
    return f"stage {stage} failed on an input {_shape(x)}: {type(error).__name__}: {error}"
