"""The weight predictor's frame: Ŵ = W − Σ lr·Δ written per parameter, with Δ read from the
optimizer's state by a subclass or recorded as the last applied displacement.

Why apart from the rules (:mod:`.moments`, :mod:`.matrix`): the frame (the rates summed over
the next s updates, the fused write, the kept Δ, the displacement record around ``step()``,
checkpoints) is the same for every rule; a rule only says where Δ comes from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.config import is_whole
from pipeoptim.runtime.optim.update_persistence import UpdatePersistence

__all__ = [
    "Deltas",
    "DisplacementPredictor",
    "Tensor",
    "WeightPredictor",
    "check_distance",
    "param_state",
]

Tensor = torch.Tensor
Deltas = list[list[Tensor | None]]


def check_distance(s: int) -> int:
    """``s`` checked: a count of future updates, 0 or more."""
    if not is_whole(s, 0):
        raise RuntimeConfigError(
            f"the prediction distance s is a count of future optimizer updates and must be an "
            f"integer >= 0 (got {s!r}); pass s = number of updates between the forward and "
            f"the backward of the mini-batch (0 runs the forward on the current weights)"
        )
    return int(s)


def param_state(optimizer: Optimizer, p: Tensor) -> dict[str, Any]:
    """``p``'s optimizer state, empty where it has none yet."""
    # .get: optimizer.state is a defaultdict and indexing would create empty entries.
    st = optimizer.state.get(p)
    return st if st else {}


class WeightPredictor:
    """Base class: predicts ``Ŵ = W − Σ lr·Δ`` per parameter from optimizer state.

    Subclasses choose Δ per param group: either from the optimizer state
    (``_state_deltas``) or from the recorded last displacement (``_uses_displacement``).
    """

    name: ClassVar[str] = "base"
    options: ClassVar[frozenset[str]] = frozenset({"auto_hooks"})
    keeps_deltas: ClassVar[bool] = False
    """Keep a computed Δ until the next step: for rules that predict several times per
    update (micro-batches of one mini-batch), at the cost of one weight-sized buffer."""
    fuses_first_write: ClassVar[bool] = False
    """A rule that keeps Δ but can write Ŵ without forming it (:meth:`_write_fused`) does
    so for a group's first prediction after a step and keeps nothing; only a second
    prediction before the next step forms Δ and keeps it. Where every update is followed
    by one prediction (XPipe with M >= P: one distance per mini-batch), no Δ is formed."""

    def __init__(self, optimizer: Optimizer, *, auto_hooks: bool = True) -> None:
        if not isinstance(optimizer, Optimizer):
            raise RuntimeConfigError(
                f"a weight predictor reads a torch.optim.Optimizer's state (got "
                f"{type(optimizer).__name__}); pass the stage's optimizer"
            )
        self.optimizer = optimizer
        # Displacement record, one buffer per tracked parameter: holds W^(j-1) between
        # before_step and after_step, then Δ = (W^(j-1) − W^(j)) / lr (the buffer is reused).
        self._buf: dict[Tensor, Tensor] = {}
        self._has_delta: set[Tensor] = set()
        self._pending: list[tuple[list[Tensor], list[Tensor], float]] | None = None
        self._kept: dict[int, list[Tensor | None]] = {}  # Δ per group index, until a step
        self._written: set[int] = set()  # groups written fused since the last step
        self.kept_computations = 0
        """How many times a Δ was computed and kept (a caller's memory count goes stale)."""
        # Hooks on the optimizer make the record impossible to forget and skip steps that
        # never happen (e.g. GradScaler skipping an inf step); explicit calls stay harmless.
        self.persistence: UpdatePersistence | None = None
        """Set by the ``shrunk`` rule: the next s updates are weighted by the measured
        persistence of the optimizer's update (``optim/update_persistence.py``) instead of 1."""
        self._hooks: list[RemovableHandle] = []
        if auto_hooks:
            self._hooks = [
                optimizer.register_step_pre_hook(lambda *_: self.before_step()),
                optimizer.register_step_post_hook(lambda *_: self.after_step()),
                optimizer.register_load_state_dict_post_hook(lambda *_: self._drop_kept()),
            ]

    # -- what subclasses decide ------------------------------------------------------------
    def _uses_displacement(self, group: dict[str, Any]) -> bool:
        return False

    def _state_deltas(self, group: dict[str, Any]) -> list[Tensor | None]:
        raise NotImplementedError

    # -- Δ ---------------------------------------------------------------------------------
    def _group_deltas(self, group: dict[str, Any], index: int) -> list[Tensor | None]:
        # May alias optimizer state or the displacement buffer: internal use only.
        params: list[Tensor] = group["params"]
        if self._uses_displacement(group):
            ds: list[Tensor | None] = [
                self._buf[p] if p in self._has_delta else None for p in params
            ]
        elif self.keeps_deltas and self._hooks:  # the step hook drops what is kept
            kept = self._kept.get(index)
            if kept is None:
                kept = self._kept[index] = self._state_deltas(group)
                self.kept_computations += 1
            ds = kept
        else:
            ds = self._state_deltas(group)
        # Frozen parameters are never updated by torch.optim: forward uses W as it is.
        return [d if p.requires_grad else None for p, d in zip(params, ds, strict=True)]

    def prepare_deltas(self) -> None:
        """Compute and keep Δ now, for every param group that would keep one at its first
        prediction (:attr:`keeps_deltas`, kept while a step hook can drop it, and not fused
        by :attr:`fuses_first_write`): the stage calls it at the end of its update, once the
        weights and hyper-parameters are final (a correction's ``after_step``, the
        scheduler), so the work lands in the update and the next predicted forward only
        writes Ŵ. The same Δ, from the same state, as the first prediction would form: the
        predictions are unchanged. A group already kept is left as it is."""
        if not self.keeps_deltas or self.fuses_first_write or not self._hooks:
            return
        with torch.no_grad():
            for index, group in enumerate(self.optimizer.param_groups):
                if not self._uses_displacement(group):
                    self._group_deltas(group, index)

    def _drop_kept(self) -> None:
        """Forget what was kept or written since the last step (the state moves on)."""
        self._kept.clear()
        self._written.clear()

    def _may_fuse(self, index: int) -> bool:
        """Whether group ``index``'s Ŵ may be written without forming Δ now: always for a
        rule that keeps none, or where no step hook could drop a kept Δ (nothing is kept
        then); for one that keeps Δ, only for its first prediction after a step, where it
        fuses that (:attr:`fuses_first_write`)."""
        if not self.keeps_deltas or not self._hooks:
            return True
        return self.fuses_first_write and index not in self._kept and index not in self._written

    def delta(self) -> Deltas:
        """Δ per param group, per parameter (fresh tensors); None: no state yet, Δ = 0."""
        with torch.no_grad():
            return [
                [None if d is None else d.detach().clone() for d in self._group_deltas(g, i)]
                for i, g in enumerate(self.optimizer.param_groups)
            ]

    # -- prediction ------------------------------------------------------------------------
    def _params(self) -> list[Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _etas(self, s: int, lrs: Sequence[Sequence[float]] | None) -> list[float]:
        groups = self.optimizer.param_groups
        weights = self.persistence.weights(s) if self.persistence is not None else [1.0] * s
        if lrs is None:
            return [float(g["lr"]) * math.fsum(weights) for g in groups]
        if len(lrs) != len(groups) or any(len(row) < s for row in lrs):
            raise RuntimeConfigError(
                f"lrs must hold, for each of the optimizer's {len(groups)} param groups, the "
                f"learning rates of the next s={s} updates (got {len(lrs)} groups with "
                f"{[len(row) for row in lrs]} rates); build it with future_lrs(scheduler, "
                f"optimizer, s) or pass lrs=None to use the current lr"
            )
        return [
            math.fsum(float(x) * w for x, w in zip(row[:s], weights, strict=False)) for row in lrs
        ]

    def predict_into(
        self, dest: list[Tensor], s: int, lrs: Sequence[Sequence[float]] | None = None
    ) -> None:
        """Write Ŵ for every parameter (flattened group order) into the preallocated ``dest``.

        ``lrs[g]`` lists the learning rates of group g's next updates (at least s of them,
        the first s are used): Σ lr replaces lr·s under a schedule.
        """
        s = check_distance(s)
        self._check_dest(dest)
        etas = self._etas(s, lrs)
        with torch.no_grad():
            # Ŵ = W − η·Δ written once per element where dest is not W itself and Δ exists
            # (read W, read Δ, write Ŵ); the rest is copied, or updated in place.
            copies: list[tuple[Tensor, Tensor]] = []
            in_place: list[tuple[Tensor, Tensor, float]] = []
            offset = 0
            for index, (group, eta) in enumerate(
                zip(self.optimizer.param_groups, etas, strict=True)
            ):
                ps: list[Tensor] = group["params"]
                moving = s > 0 and eta != 0.0
                fused = moving and self._may_fuse(index)
                if fused and self._write_fused(group, eta, dest[offset : offset + len(ps)]):
                    self._written.add(index)
                    offset += len(ps)
                    continue
                deltas = self._group_deltas(group, index) if moving else [None] * len(ps)
                for i, (p, d) in enumerate(zip(ps, deltas, strict=True)):
                    out = dest[offset + i]
                    same = out.data_ptr() == p.data_ptr()
                    if d is None:
                        if not same:
                            copies.append((out, p))
                    elif same:
                        in_place.append((out, d, eta))
                    else:
                        torch.add(p.detach(), d, alpha=-eta, out=out)
                offset += len(ps)
            if copies:
                torch._foreach_copy_([d for d, _ in copies], [p for _, p in copies])
            for out, d, eta in in_place:
                out.add_(d, alpha=-eta)

    def _check_dest(self, dest: list[Tensor]) -> None:
        n = len(self._params())
        if len(dest) != n:
            raise RuntimeConfigError(
                f"predict_into needs one destination tensor per optimizer parameter (got "
                f"{len(dest)} for {n} parameters); allocate dest in the order "
                f"'for group in param_groups for p in group[\"params\"]'"
            )

    def _write_fused(self, group: dict[str, Any], eta: float, dest: list[Tensor]) -> bool:
        """Write the group's Ŵ into ``dest`` without forming Δ, where the rule can; False
        leaves it to the general path."""
        return False

    def predicted(self, s: int, lrs: Sequence[Sequence[float]] | None = None) -> list[Tensor]:
        """Convenience form of :meth:`predict_into` that allocates the predicted copy."""
        dest = [torch.empty_like(p) for p in self._params()]
        self.predict_into(dest, s, lrs)
        return dest

    # -- displacement record ---------------------------------------------------------------
    def before_step(self) -> None:
        """Record W^(j-1) of displacement-tracked parameters (call right before step())."""
        self._drop_kept()  # the moments and the weights are about to change
        if self._pending is not None:  # already recorded for this step (hook + explicit call)
            return
        pending: list[tuple[list[Tensor], list[Tensor], float]] = []
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                if not self._uses_displacement(group):
                    continue
                lr = float(group["lr"])
                live = [p for p in group["params"] if p.grad is not None and lr != 0.0]
                # Parameters step() will not touch have no last displacement to repeat.
                self._has_delta.difference_update(group["params"])
                if not live:
                    continue
                bufs = [self._buf.get(p) for p in live]
                for i, p in enumerate(live):
                    if bufs[i] is None:
                        self._buf[p] = bufs[i] = torch.empty_like(p)
                ready = [b for b in bufs if b is not None]
                torch._foreach_copy_(ready, live)
                pending.append((live, ready, lr))
        self._pending = pending

    def after_step(self) -> None:
        """Turn the record into Δ = (W^(j-1) − W^(j)) / lr (call right after step())."""
        self._drop_kept()
        if self._pending is None:
            return
        with torch.no_grad():
            for live, bufs, lr in self._pending:
                torch._foreach_sub_(bufs, live)
                torch._foreach_div_(bufs, lr)
                self._has_delta.update(live)
        self._pending = None

    def close(self) -> None:
        """Remove the hooks this predictor put on the optimizer."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drop_kept()
        if self.persistence is not None:
            self.persistence.close()

    def held_tensors(self) -> list[Tensor]:
        """Tensors this predictor keeps between steps (for memory accounting): recorded
        displacements and a kept Δ."""
        params = self._params()
        held = [self._buf[p] for p in params if p in self._buf]
        held += [d for ds in self._kept.values() for d in ds if d is not None]
        return held

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Rule name and the recorded displacements (by flat parameter index; tensors are
        references, as in ``Optimizer.state_dict``)."""
        state: dict[str, Any] = {"rule": self.name, "displacement": self._displacements()}
        if self.persistence is not None:
            state["persistence"] = self.persistence.state_dict()
        return state

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("rule") != self.name:
            raise RuntimeConfigError(
                f"checkpoint holds the state of a {d.get('rule')!r} weight predictor but this "
                f"stage uses {self.name!r}; build the predictor with the same rule and optimizer"
            )
        n = len(self._params())
        disp: dict[int, Tensor] = d.get("displacement", {})
        bad = [i for i in disp if not 0 <= int(i) < n]
        if bad:
            raise RuntimeConfigError(
                f"checkpoint has displacements for parameter indices {bad} but the optimizer "
                f"has {n} parameters; load it into the stage it was saved from"
            )
        if self.persistence is not None and d.get("persistence") is not None:
            self.persistence.load_state_dict(d["persistence"])
        self._load_displacements({int(i): t for i, t in disp.items()})

    def _displacements(self) -> dict[int, Tensor]:
        """The recorded displacements by flat parameter index."""
        params = self._params()
        return {i: self._buf[p] for i, p in enumerate(params) if p in self._has_delta}

    def _load_displacements(self, disp: dict[int, Tensor]) -> None:
        params = self._params()
        self._buf, self._has_delta, self._pending = {}, set(), None
        self._drop_kept()
        for i, t in disp.items():
            p = params[i]
            self._buf[p] = t.detach().to(device=p.device, dtype=p.dtype, copy=True)
            self._has_delta.add(p)


class DisplacementPredictor(WeightPredictor):
    """Any optimizer: Δ = last applied displacement (W^(j-1) − W^(j)) / lr."""

    name = "displacement"

    def _uses_displacement(self, group: dict[str, Any]) -> bool:
        return True
