"""Does a saved stage state fit this stage? Checked before anything of it is loaded.

Why apart from the stage: a resume (and ``Pipeline.load_state_dict``) must refuse a state
that does not fit *before* it overwrites anything, with one error that names the stage and
what differs, instead of torch's errors from half way through a load (``load_state_dict``
of a module copies the tensors that fit before it complains about the rest, and an optimizer
fails on a foreign state after it took it). The optimizer's own part of the check is
:meth:`~pipeoptim.runtime.optim.update.StageUpdate.check_state`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError

__all__ = ["check_module_state", "check_predictor_state", "check_stage_state", "refusal"]

_SHOWN = 3
"""Names shown per kind of difference (the count says how many more)."""


def _few(items: list[str]) -> str:
    more = len(items) - _SHOWN
    return ", ".join(items[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def refusal(refused: list[tuple[int, str]]) -> str | None:
    """One message for the stages that refused their state, ``(stage, error)`` each: the
    first stage's error, naming the others (None: every stage took its state)."""
    if not refused:
        return None
    refused = sorted(refused)
    others = [str(k) for k, _ in refused[1:]]
    verb = "stages {} do not" if len(others) > 1 else "stage {} does not"
    more = f" ({verb.format(', '.join(others))} fit either)"
    return refused[0][1] + (more if others else "")


def check_stage_state(state: Any, where: str) -> None:
    """The shape of a stage state: a dict with the module's tensors and the RNG state."""
    if not isinstance(state, dict) or not isinstance(state.get("module"), Mapping):
        raise RuntimeConfigError(
            f"{where}: the state is not a stage state (a dict with 'module', 'optimizer', "
            f"'rng'..., as Stage.state_dict() returns, got {type(state).__name__}); load what "
            f"Pipeline.state_dict() or a pipeoptim checkpoint holds; nothing was loaded"
        )
    rng = state.get("rng")
    if not isinstance(rng, Tensor) or rng.dtype != torch.uint8:
        raise RuntimeConfigError(
            f"{where}: the state has no RNG state (a uint8 tensor under 'rng', got "
            f"{type(rng).__name__}); load what Pipeline.state_dict() or a pipeoptim "
            f"checkpoint holds; nothing was loaded"
        )


def check_module_state(module: nn.Module, saved: Mapping[str, Any], where: str) -> None:
    """The saved weights and buffers have this stage's names and shapes (another model, or
    another split into stages, does not)."""
    mine = {n: tuple(t.shape) for n, t in module.state_dict().items() if isinstance(t, Tensor)}
    theirs = {n: tuple(t.shape) for n, t in saved.items() if isinstance(t, Tensor)}
    missing = [n for n in mine if n not in theirs]
    unexpected = [n for n in theirs if n not in mine]
    shapes = [
        f"{n} saved {list(theirs[n])}, here {list(s)}"
        for n, s in mine.items()
        if n in theirs and theirs[n] != s
    ]
    if not (missing or unexpected or shapes):
        return
    found = []
    if shapes:
        found.append(f"other shapes: {_few(shapes)}")
    if missing:
        found.append(f"not in the state: {_few(missing)}")
    if unexpected:
        found.append(f"not in this stage: {_few(unexpected)}")
    raise RuntimeConfigError(
        f"{where}: the saved weights do not fit this stage's layers ({'; '.join(found)}); "
        f"they were saved from another model or another split into stages: load a state "
        f"saved by a Pipeline of the same layers, stages and boundaries; nothing was loaded"
    )


def check_predictor_state(
    rule: str | None, saved: Any, method: str, num_params: int, where: str
) -> None:
    """The saved predictor state is of this stage's prediction rule (``rule``; None: the
    stage does not predict), over as many parameters."""
    if saved is None and rule is None:
        return
    if rule is None:
        theirs = saved.get("rule") if isinstance(saved, dict) else None
        raise RuntimeConfigError(
            f"{where}: the state holds the state of a {theirs!r} weight predictor, saved by a "
            f"predicting method, but this stage's method {method} does not predict; build "
            f"the Pipeline with the method that saved it; nothing was loaded"
        )
    if saved is None:
        raise RuntimeConfigError(
            f"{where}: the state was saved by a method that does not predict, but this "
            f"stage's method {method} predicts (rule {rule!r}) and needs its predictor's "
            f"state; build the Pipeline with the method that saved it; nothing was loaded"
        )
    theirs = saved.get("rule") if isinstance(saved, dict) else None
    if theirs != rule:
        raise RuntimeConfigError(
            f"{where}: the state holds the state of a {theirs!r} weight predictor but this "
            f"stage predicts with {rule!r} (the method and the optimizer family choose the "
            f"rule); build the Pipeline with the method and optimizer that saved it; nothing "
            f"was loaded"
        )
    disp = saved.get("displacement", {})
    bad = sorted(int(i) for i in disp if not 0 <= int(i) < num_params)
    if bad:
        raise RuntimeConfigError(
            f"{where}: the saved predictor has displacements for parameter indices {bad} but "
            f"this stage has {num_params} parameters; load it into the stage it was saved "
            f"from; nothing was loaded"
        )
