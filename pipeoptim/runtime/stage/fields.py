"""What a stage holds, declared once for the modules that each run one part of its work.

Why a module of declarations: :class:`~pipeoptim.runtime.stage.stage.Stage` is written in
several modules, one concern each (the forward, the backward, the prediction, the checkpoint
state), as classes it inherits; each reads the state the stage's ``__init__`` builds. Declared
here, each of those modules type-checks on its own and imports nothing of ``stage.py``, which
stays above its parts (``tests/test_layering.py``). The methods are plain methods of the
stage, so a pass calls them as it did when they sat in one class, with no added indirection.

The attributes are documented where ``Stage.__init__`` sets them.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeoptim.plan.methods import Method, WeightPolicy
from pipeoptim.plan.versions import MicroBatchVersions, prediction_distance
from pipeoptim.runtime.optim.predict import WeightPredictor
from pipeoptim.runtime.optim.prediction_closure import PredictionClosure
from pipeoptim.runtime.optim.update import StageUpdate
from pipeoptim.runtime.payload import Payload
from pipeoptim.runtime.stage.accumulate_in_product import AccumulateInProduct
from pipeoptim.runtime.stage.loss import LossFn
from pipeoptim.runtime.stage.memory import StageMemory
from pipeoptim.runtime.stage.precision import Precision
from pipeoptim.runtime.stage.recompute import Recomputation
from pipeoptim.runtime.stage.rng import StageRandom
from pipeoptim.runtime.stage.split_backward import KeptUnits, WeightHalf
from pipeoptim.runtime.stage.swap import ParameterSlots
from pipeoptim.runtime.stage.weights import WeightVersions

__all__ = ["StageFields"]


class StageFields:
    """The state a stage's parts read (set in ``Stage.__init__``), and the versions each
    micro-batch meets, which every part asks."""

    # what the stage is
    index: int
    is_last: bool
    device: torch.device
    module: nn.Sequential
    method: Method
    policy: WeightPolicy
    micro_batches: int
    replicas: int
    prediction_offset: int
    loss_fn: LossFn
    first_unit: int
    _params: list[nn.Parameter]
    # its parts
    precision: Precision
    weights: WeightVersions
    memory_count: StageMemory
    random: StageRandom
    recompute: Recomputation | None
    optimizer: Optimizer | None
    updater: StageUpdate | None
    predictor: WeightPredictor | None
    closure: PredictionClosure | None
    _slots: ParameterSlots
    _in_product: AccumulateInProduct | None
    # what its passes leave for later ones
    correct: Tensor | None
    predicted_backward: bool
    _reads_buffer: bool
    _split: bool
    _unit_params: list[list[Tensor]] | None
    _saved: dict[int, tuple[Payload, Payload]]
    _units_out: dict[int, KeptUnits]
    _weight_half: dict[int, WeightHalf]
    _unfinished: tuple[MicroBatchVersions, Payload] | None
    _backwards_since_update: int
    _updates_before_segment: int
    _delays: dict[int, int]
    _prediction_key: tuple[int, int] | None
    _group_order: list[int] | None
    prediction_seconds: deque[float]

    def versions(self, mb: int) -> MicroBatchVersions:
        """The versions micro-batch ``mb`` of this segment meets on this stage."""
        return self.weights.of(mb)

    @property
    def version(self) -> int:
        """Updates made in this segment: the live weights are this version."""
        return self.weights.current

    def distance(self, mb: int) -> int:
        """The prediction distance this stage uses for ``mb`` (0 if it does not predict)."""
        if self.predictor is None:
            return 0
        return prediction_distance(self.versions(mb).distance, self.prediction_offset)
