"""Weight predictors: the weights a mini-batch will meet at backward time, read off the optimizer.

Why: in asynchronous 1F1B (no flush) stage k runs mini-batch t's forward while s updates are
still to come before t's backward; PipeOptim runs that forward on ``Ŵ = W − lr·s·Δ`` so both
passes see (nearly) one version. SpecTrain and XPipe differ only in Δ (docs/design.md,
"Weight-version semantics", "Prediction per optimizer family"). Δ is *read* from the user's
``torch.optim`` state (or computed by torch's own functions from it, as Muon's
orthogonalisation), never re-implemented. Where the state lacks the applied direction (SGD with
μ = 0 or Nesterov, RMSprop without momentum, other optimizers) the last applied displacement
``(W^(j-1) − W^(j)) / lr`` is recorded around ``step()``: exact, for one extra copy.
Prediction uses ``torch._foreach_*`` ops, so it costs about one optimizer step.

The predictors live in :mod:`pipeoptim.runtime.optim.predictors` (by where Δ comes from) and
each optimizer family names its own (:mod:`pipeoptim.runtime.optim.families`); this module
chooses one for a method's rule and an optimizer, and keeps the names other code imports.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Adam, AdamW, NAdam, Optimizer, RAdam

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.families import own_predictor
from pipeoptim.runtime.optim.predictors.base import (
    Deltas,
    DisplacementPredictor,
    Tensor,
    WeightPredictor,
    check_distance,
)
from pipeoptim.runtime.optim.predictors.matrix import (
    BasisRotationPredictor,
    MuonPredictor,
    MuonWithAdamWPredictor,
)
from pipeoptim.runtime.optim.predictors.moments import (
    AdamPredictor,
    NAdamPredictor,
    RMSpropPredictor,
    SGDPredictor,
    SpecTrainPredictor,
    XPipePredictor,
)
from pipeoptim.runtime.optim.update_persistence import UpdatePersistence

__all__ = [
    "RULES",
    "AdamPredictor",
    "BasisRotationPredictor",
    "Deltas",
    "DisplacementPredictor",
    "MuonPredictor",
    "MuonWithAdamWPredictor",
    "NAdamPredictor",
    "RMSpropPredictor",
    "SGDPredictor",
    "SpecTrainPredictor",
    "Tensor",
    "WeightPredictor",
    "XPipePredictor",
    "check_distance",
    "predictor_for",
]

#: Valid values of ``predictor_for(..., rule=...)``.
RULES: tuple[str, ...] = ("optimizer", "spectrain", "xpipe", "displacement", "shrunk")

# XPipe's Adam form applies to the optimizers whose state holds Adam's two moments.
_ADAM_LIKE: tuple[type[Optimizer], ...] = (Adam, AdamW, NAdam, RAdam)


def predictor_for(optimizer: Optimizer, rule: str = "optimizer", **options: Any) -> WeightPredictor:
    """The predictor of a method's prediction rule for this optimizer.

    "optimizer": the rule of the family whose class ``type(optimizer)`` is exactly
    (``families/``: SGD, Adam, AdamW, NAdam, RMSprop, Muon, MuonWithAdamW, BasisRotation),
    else displacement;
    "spectrain": smoothed gradient; "xpipe": Adam-form Δ for Adam-like optimizers, the
    optimizer's own rule otherwise; "displacement": last applied displacement; "shrunk":
    the optimizer's own rule with the next s updates weighted by how much of the update
    persists (``runtime/optim/update_persistence.py``).
    """
    if rule not in RULES:
        raise RuntimeConfigError(
            f"unknown weight-prediction rule {rule!r}; valid rules are {', '.join(RULES)}"
        )
    cls: type[WeightPredictor]
    if rule == "spectrain":
        cls = SpecTrainPredictor
    elif rule == "displacement":
        cls = DisplacementPredictor
    elif rule == "xpipe" and type(optimizer) in _ADAM_LIKE:
        cls = XPipePredictor
    else:
        cls = own_predictor(type(optimizer))
    unknown = sorted(set(options) - cls.options)
    if unknown:
        raise RuntimeConfigError(
            f"option(s) {unknown} do not apply to the {cls.name!r} predictor chosen for rule "
            f"{rule!r} and {type(optimizer).__name__}; valid options: {sorted(cls.options)}"
        )
    predictor = cls(optimizer, **options)
    if rule == "shrunk":  # the optimizer's own rule, over the distance its updates persist
        predictor.persistence = UpdatePersistence(optimizer)
        for part in getattr(predictor, "parts", []):
            part.persistence = predictor.persistence
    return predictor
