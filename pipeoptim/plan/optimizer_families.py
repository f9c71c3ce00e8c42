"""The optimizer families by name, without torch: what the planner, the simulator and the
command line know of an optimizer before any is built.

Why a table apart from the torch side (``pipeoptim.runtime.optim.families``): plan/ and sim/
never import torch, yet they need a family's state size, whether its step cost follows the
matrix shapes, and its default learning rate. Each torch-side family module names its entry
here and reads these fields from it, so the two cannot disagree; a name a user types
(``--optimizer``, a Plan file's ``optimizer.family``) is looked up here once, and the code asks
the entry a question instead of comparing the name.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeoptim.errors import PlanError

__all__ = [
    "ADAM",
    "ADAMW",
    "ANY_TORCH_OPTIMIZER",
    "BASIS_ROTATION",
    "FAMILIES",
    "FAMILY_NAMES",
    "MUON",
    "NADAM",
    "RMSPROP",
    "SGD",
    "OptimizerFamily",
    "find_family",
    "optimizer_family",
]


@dataclass(frozen=True)
class OptimizerFamily:
    """One optimizer family as the planner sees it."""

    name: str
    """What a user types (``--optimizer``, a Plan file's ``optimizer.family``)."""
    description: str
    """One line: the torch optimizer it builds and what it keeps."""
    default_lr: float
    """The learning rate a run takes when none is given."""
    state_copies: tuple[int, int] | None
    """Optimizer-state bytes per parameter byte, without and with momentum (None: not known
    before a step, the profiler measures it)."""
    momentum_by_default: bool
    """Whether the usual setting keeps a momentum buffer (SGD's 0.9; RMSprop's none)."""
    momentum_option: bool
    """Whether a momentum switch changes the state it keeps (SGD, RMSprop): the profiler's
    ``momentum`` argument then sets the optimizer's ``momentum`` option."""
    shaped_step: bool
    """Whether its step does matrix work on each 2-D parameter (Newton–Schulz, rotations),
    so its cost follows the shapes, not only the bytes."""
    state_from_shapes: bool = False
    """Whether the state is no fixed multiple of the parameter bytes and is counted from the
    shapes instead (basis rotation's covariances and bases)."""
    decoupled_decay_option: bool = False
    """Whether its torch constructor couples weight decay into the gradient unless told
    ``decoupled_weight_decay=True`` (NAdam): the study decouples it, as AdamW does."""
    study_lrs: tuple[float, ...] = ()
    """The learning rates the convergence study sweeps for it (none: not studied)."""

    def state_factor(self, *, momentum: bool | None = None) -> int:
        """Parameter-sized state tensors per parameter; ``momentum=None`` takes the usual
        setting (:attr:`momentum_by_default`)."""
        if self.state_copies is None:
            raise PlanError(
                f"the state size of {self.name!r} is not known before a step; profile the "
                f"model (the profiler measures it) or give optimizer_state_bytes explicitly"
            )
        without, with_momentum = self.state_copies
        use_momentum = self.momentum_by_default if momentum is None else momentum
        return with_momentum if use_momentum else without


SGD = OptimizerFamily(
    name="sgd",
    description="torch.optim.SGD, momentum 0.9 unless given (one momentum buffer)",
    default_lr=0.02,
    state_copies=(0, 1),
    momentum_by_default=True,
    momentum_option=True,
    shaped_step=False,
    study_lrs=(0.01, 0.02, 0.04, 0.08),
)
ADAM = OptimizerFamily(
    name="adam",
    description="torch.optim.Adam (two moments)",
    default_lr=1e-3,
    state_copies=(2, 2),
    momentum_by_default=True,
    momentum_option=False,
    shaped_step=False,
    study_lrs=(5e-4, 1e-3, 2e-3, 4e-3),
)
ADAMW = OptimizerFamily(
    name="adamw",
    description="torch.optim.AdamW (two moments, decoupled weight decay)",
    default_lr=1e-3,
    state_copies=(2, 2),
    momentum_by_default=True,
    momentum_option=False,
    shaped_step=False,
    study_lrs=(5e-4, 1e-3, 2e-3, 4e-3),
)
RMSPROP = OptimizerFamily(
    name="rmsprop",
    description="torch.optim.RMSprop (the square average, and a momentum buffer if asked)",
    default_lr=1e-3,
    state_copies=(1, 2),
    momentum_by_default=False,
    momentum_option=True,
    shaped_step=False,
)
NADAM = OptimizerFamily(
    name="nadam",
    description="torch.optim.NAdam (two moments, Nesterov momentum)",
    default_lr=1e-3,
    state_copies=(2, 2),
    momentum_by_default=True,
    momentum_option=False,
    shaped_step=False,
    decoupled_decay_option=True,
    study_lrs=(5e-4, 1e-3, 2e-3, 4e-3),
)
MUON = OptimizerFamily(
    name="muon",
    description="Muon on the 2-D weight matrices, AdamW on the rest",
    default_lr=1e-3,
    # One momentum buffer per matrix (most of the bytes); AdamW's two moments for the rest
    # are counted as one more.
    state_copies=(1, 1),
    momentum_by_default=True,
    momentum_option=False,
    shaped_step=True,
    # MuonWithAdamW matches AdamW's update size (match_rms_adamw): AdamW's rates
    study_lrs=(5e-4, 1e-3, 2e-3, 4e-3),
)
BASIS_ROTATION = OptimizerFamily(
    name="basis-rotation",
    description="Adam in each matrix's gradient eigenbasis, Adam on the rest",
    default_lr=3e-3,  # the paper's code's default; at 1e-3 it lags AdamW on mlp
    # m and v (2) plus, per matrix side of length n, an n×n covariance and an n×n basis:
    # 2·(r² + c²)/(r·c) more for an r×c matrix, 4 for a square one (the count here), more
    # for rectangular ones, none for vectors (2 in all). Not a fixed multiple: a measured
    # profile records the real bytes (the profiler steps the real shapes, or counts them).
    state_copies=(6, 6),
    momentum_by_default=True,
    momentum_option=False,
    shaped_step=True,
    state_from_shapes=True,
)
ANY_TORCH_OPTIMIZER = OptimizerFamily(
    name="torch",
    description="any other torch.optim optimizer, from a user's factory (not a name to type)",
    default_lr=1e-3,
    state_copies=None,
    momentum_by_default=False,
    momentum_option=False,
    shaped_step=False,
)
"""The family of an optimizer no name above builds (a user's factory): not a choice of
``--optimizer``, so not in :data:`FAMILIES`."""

FAMILIES: dict[str, OptimizerFamily] = {
    f.name: f for f in (SGD, ADAM, ADAMW, RMSPROP, NADAM, MUON, BASIS_ROTATION)
}
"""Every family a user may name, in the order the command line lists them."""
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)


def find_family(name: str) -> OptimizerFamily | None:
    """The family named ``name`` (any case), or None."""
    return FAMILIES.get(name.lower())


def optimizer_family(name: str) -> OptimizerFamily:
    """The family named ``name`` (any case); an unknown name is refused with the names."""
    family = find_family(name)
    if family is None:
        raise PlanError(
            f"unknown optimizer family {name!r}; choose one of: {', '.join(FAMILY_NAMES)}"
        )
    return family
