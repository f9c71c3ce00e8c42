"""A stage's checkpoint state: saved, checked against the stage, loaded.

Why its own module: what a stage saves (weights, optimizer, scheduler, loss scaler,
correction, predictor, random stream) is read back by a later run, perhaps another build of
the stage; the checks (:mod:`~pipeoptim.runtime.checkpoint.state_check`) refuse a state that
does not fit before anything is loaded, so a refused resume leaves the stage as it was.
"""

from __future__ import annotations

from typing import Any

from pipeoptim.runtime.checkpoint.recut import optimizer_param_names
from pipeoptim.runtime.checkpoint.state_check import (
    check_module_state,
    check_predictor_state,
    check_stage_state,
)
from pipeoptim.runtime.stage.backward import StageBackward

__all__ = ["StageState"]


class StageState(StageBackward):
    """The checkpoint state of a stage; valid between segments (it finishes a deferred
    backward first)."""

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer (and its parameters' names), scheduler, loss scaler,
        correction, predictor and RNG state; only valid between segments."""
        self.finish_backward()
        if self._saved or self.weights.stash:
            raise RuntimeError(f"stage {self.index}: checkpoint with passes in flight")
        update: dict[str, Any] = (
            self.updater.state_dict()
            if self.updater is not None
            else {"optimizer": None, "scheduler": None, "scaler": None, "correction": None}
        )
        if self.updater is not None and self.optimizer is not None:
            # each optimizer index's module names: a resume onto another cut finds the
            # parameter's state by its model-level name (checkpoint/recut.py)
            update["param_names"] = optimizer_param_names(self.module, self.optimizer)
        return {
            "module": self.module.state_dict(),
            **update,
            "predictor": None if self.predictor is None else self.predictor.state_dict(),
            "rng": self.random.state,
        }

    def check_state(self, state: Any) -> None:
        """Refuse a :meth:`state_dict` that does not fit this stage, before anything is
        loaded (``state_check.py``): other layers or split, another optimizer, another
        prediction rule; the error names the stage and what differs."""
        self._check_own_state(state, optimizer=True)

    def _check_own_state(self, state: Any, *, optimizer: bool) -> None:
        """:meth:`check_state`; the optimizer's part (``StageUpdate``'s) only with
        ``optimizer`` (its own load checks it)."""
        where = f"stage {self.index}"
        check_stage_state(state, where)
        check_module_state(self.module, state["module"], where)
        if optimizer and self.updater is not None:
            self.updater.check_state(state)
        rule = self.predictor.name if self.predictor is not None else None
        saved = state.get("predictor")
        check_predictor_state(rule, saved, self.method.name, len(self._params), where)

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Load a :meth:`state_dict`; one that does not fit is refused with nothing loaded
        (:meth:`check_state`). Where this stage was built with other base learning rates
        than the saved run, the loaded (scheduled) rates are rescaled to them, so a resume
        can change the lr and keep the schedule's progress; returns what changed."""
        self.finish_backward()
        self._check_own_state(state, optimizer=False)
        # The optimizer first: it checks its part before it takes anything.
        changes = self.updater.load_state_dict(state) if self.updater is not None else []
        self.module.load_state_dict(state["module"])
        self._prediction_key = None  # other weights and optimizer state
        if self.predictor is not None and state.get("predictor") is not None:
            self.predictor.load_state_dict(state["predictor"])
        self.random.state = state["rng"].clone()
        self.memory_count.refresh()
        return changes
